"""Activation checkpointing (recompute) for ``fully_shard`` models: upstream hyper_parallel's
names, built on MindSpore's non-reentrant recompute (saved-tensor hooks).

``checkpoint(fn, *args)`` runs ``fn`` keeping none of its activations; backward re-runs it to
rebuild them. Inside a ``fully_shard`` unit that re-run reads the parameters the unit's backward
has gathered already: it gathers nothing more, reshards nothing and prefetches nothing (the
unit's hooks see :func:`is_recomputing`), and the gradients go through the unit's own reduce as
without recompute. MindSpore's ``Cell.recompute()`` and ``mindspore.recompute(...,
use_reentrant=False)`` work the same way under ``fully_shard`` (docs/using-fully-shard.md,
"Training patterns").
"""
from __future__ import annotations

import enum
from typing import Callable, Optional

import mindspore as ms
from mindspore import nn

from gradpool import InvalidArgumentError
from hyper_parallel.core.not_provided import (ACTIVATION_SWAP, RECOMPUTE_EXCLUDE, refused_class,
                                              refused_function)
from hyper_parallel.platform.mindspore.fully_shard.autograd import replaying_forward

__all__ = ["checkpoint", "checkpoint_wrapper", "CheckpointPolicy", "is_recomputing",
           "SwapManager", "swap_wrapper", "checkpoint_exclude_wrapper"]

# Upstream names whose features are not provided here: they raise when used.
SwapManager = refused_class("SwapManager", ACTIVATION_SWAP, __name__)
swap_wrapper = refused_function("swap_wrapper", ACTIVATION_SWAP, __name__)
checkpoint_exclude_wrapper = refused_function("checkpoint_exclude_wrapper", RECOMPUTE_EXCLUDE,
                                              __name__)


class CheckpointPolicy(enum.Enum):
    """Upstream's (and PyTorch's) per-op policy names for selective checkpointing."""

    MUST_SAVE = 0
    PREFER_SAVE = 1
    MUST_RECOMPUTE = 2
    PREFER_RECOMPUTE = 3


def is_recomputing() -> bool:
    """True while a checkpointed forward is being re-run in backward."""
    return replaying_forward()


def checkpoint(function: Callable, *args, policy_fn: Optional[Callable] = None,
               context_fn: Optional[Callable] = None, use_reentrant: bool = False,
               early_stop: bool = True, **kwargs):
    """``function(*args, **kwargs)`` with its activations recomputed in backward.

    ``context_fn`` (as MindSpore's): returns two context managers, entered around the forward
    and around the recompute. ``policy_fn`` (selective checkpointing: which ops to save) is
    refused: MindSpore 2.10's recompute has no per-op policy, and silently recomputing
    everything would not be what was asked. ``use_reentrant=True`` is refused too: a
    reentrant recompute differentiates only Parameters, not the gathered weights of a unit."""
    if not callable(function):
        raise InvalidArgumentError(f"checkpoint needs a callable, got {type(function).__name__}")
    if policy_fn is not None:
        raise InvalidArgumentError(
            "checkpoint(policy_fn=...): selective checkpointing is not supported (MindSpore 2.10's "
            "recompute has no per-op policy); checkpoint a smaller function instead, or pass "
            "policy_fn=None to recompute the whole function")
    if use_reentrant:
        raise InvalidArgumentError(
            "checkpoint(use_reentrant=True) is not supported: a reentrant recompute would not "
            "differentiate the parameters fully_shard gathers; use the default "
            "use_reentrant=False (same activations recomputed)")
    return ms.recompute(function, *args, use_reentrant=False, early_stop=early_stop,
                        context_fn=context_fn, **kwargs)


class _CheckpointWrapper(nn.Cell):
    """``module`` whose forward is checkpointed; its parameters keep their names (no prefix)."""

    def __init__(self, module: nn.Cell, context_fn: Optional[Callable], early_stop: bool):
        super().__init__(auto_prefix=False)
        self.checkpoint_wrapped_module = module
        self._context_fn = context_fn
        self._early_stop = early_stop

    def __getattr__(self, name: str):
        # As upstream's (and torch's) wrapper: what the wrapper lacks is the wrapped module's,
        # so code that walks a model (layer.mlp, layer.self_attention) sees through it.
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_cells", {}).get("checkpoint_wrapped_module")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def construct(self, *args, **kwargs):
        return checkpoint(self.checkpoint_wrapped_module, *args, context_fn=self._context_fn,
                          early_stop=self._early_stop, **kwargs)


def checkpoint_wrapper(module: nn.Cell, *, context_fn: Optional[Callable] = None,
                       early_stop: bool = True) -> nn.Cell:
    """A cell that runs ``module`` under :func:`checkpoint` (wrap a block before or after
    ``fully_shard``; the parameter names do not change)."""
    if not isinstance(module, nn.Cell):
        raise InvalidArgumentError(
            f"checkpoint_wrapper takes an nn.Cell, got {type(module).__name__}")
    if context_fn is not None and not callable(context_fn):
        raise InvalidArgumentError(
            f"checkpoint_wrapper(context_fn=...) takes a callable, got {type(context_fn).__name__}")
    return _CheckpointWrapper(module, context_fn, early_stop)
