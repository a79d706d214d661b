"""Names of upstream hyper_parallel's surface whose features gradpool does not provide.

mindformers imports names of tensor, context and pipeline parallelism, activation swap, NPU custom
ops and DTensor checkpoint layouts at module level, even on its FSDP-only path. Each such name is
made here: it imports, it can be subclassed, named in ``isinstance`` and passed around, and the
moment it is *used* (called, instantiated, entered as a context, or a member of it read) it raises
:class:`gradpool.FeatureNotProvidedError` naming the feature. Never an ``AttributeError`` at
import, never a silent no-op, never a plausible value.

    ContextParallel = refused_class("ContextParallel", CONTEXT_PARALLEL, __name__)
    npu_mhc_post = refused_function("npu_mhc_post", NPU_CUSTOM_OPS, __name__)

:data:`REFUSED` records every refused name (``(module, name) -> feature``) for tests and docs.
"""
from __future__ import annotations

from typing import Callable, NoReturn

from gradpool import FeatureNotProvidedError

SCOPE = ("gradpool provides FSDP/HSDP/EP only (fully_shard over 1-D and HSDP meshes, expert "
         "units through fully_shard); use upstream hyper_parallel for this feature")

TENSOR_PARALLEL = "tensor parallelism"
CONTEXT_PARALLEL = "context parallelism"
PIPELINE_PARALLEL = "pipeline parallelism"
ACTIVATION_SWAP = "activation swap (host offload of activations)"
RECOMPUTE_EXCLUDE = "selective recompute exclusion (checkpoint_exclude_wrapper)"
NPU_CUSTOM_OPS = "NPU custom ops (hyper_parallel.custom_ops)"
DTENSOR_LAYOUTS = "DTensor layouts and checkpoint layouts (tensor-parallel redistribution)"
PARALLEL_COLLECTIVES = ("differentiable collectives of tensor and context parallelism "
                        "(differentiable_all_reduce over TP/CP groups)")
EP_OVERLAP = ("expert-parallel comm/compute overlap (asynchronous all-to-all and sync hooks "
              "coordinated with pipeline stages)")
DISTRIBUTE_TENSOR = ("distribute_tensor (placing a whole tensor onto a mesh for tensor or expert "
                     "parallelism; fully_shard shards parameters itself)")

REFUSED: dict[tuple[str, str], str] = {}


def refuse(name: str, feature: str) -> NoReturn:
    raise FeatureNotProvidedError(f"{name}: {feature} is not provided; {SCOPE}")


class _RefusedMeta(type):
    """Classes that cannot be instantiated; a class member read refuses too (an enum's member,
    a classmethod). Subclasses (mindformers subclasses ``PipelineStage``) inherit the refusal."""

    def __call__(cls, *args, **kwargs):
        refuse(cls._refused_name, cls._refused_feature)

    def __getattr__(cls, attr: str):
        # Only reached for what the class does not have: dunders probed by Python's own
        # machinery (copy, pickle, typing) stay ordinary AttributeErrors.
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        refuse(f"{cls._refused_name}.{attr}", cls._refused_feature)


def refused_class(name: str, feature: str, module: str) -> type:
    """A class named ``name`` (in ``module``) that raises when instantiated or its members read."""
    cls = _RefusedMeta(name, (), {
        "__module__": module, "__qualname__": name,
        "__doc__": f"Not provided by gradpool: {feature}. Raises FeatureNotProvidedError when used.",
        "_refused_name": name, "_refused_feature": feature})
    REFUSED[(module, name)] = feature
    return cls


def refused_function(name: str, feature: str, module: str) -> Callable:
    """A function named ``name`` (in ``module``) that raises when called."""
    def refused(*args, **kwargs):
        refuse(name, feature)

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"Not provided by gradpool: {feature}. Raises FeatureNotProvidedError."
    refused._refused_feature = feature
    REFUSED[(module, name)] = feature
    return refused


def refused_feature(obj) -> str | None:
    """The feature ``obj`` refuses, or None when it is a real name."""
    return getattr(obj, "_refused_feature", None) if callable(obj) else None
