"""``fully_shard``: the upstream-compatible entry point, with every gradient reduced on pool memory.

Pool options reach ``fully_shard`` one way: the keyword-only ``pool_config=`` argument, a
:class:`gradpool.GradPoolConfig` (zero-copy, poison-on-release, bucket cap, alignment,
buckets in flight, cache cap, gradient verification). Calls written for upstream pass none and
get ``GradPoolConfig()``'s defaults.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Union

import mindspore as ms
from mindspore import nn

from gradpool import (GradPoolConfig, InvalidArgumentError, all_runtimes, check_bool,
                      runtime_for)
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.fully_shard.utils import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                   OffloadPolicy)
from hyper_parallel.platform.mindspore.fully_shard.param import MindSporeHSDPParamV2
from hyper_parallel.platform.mindspore.fully_shard.state import HSDPUnitState

__all__ = ["fully_shard", "HSDPModule", "hsdp_sync_stream", "MixedPrecisionPolicy",
           "OffloadPolicy", "CPUOffloadPolicy"]
logger = logging.getLogger(__name__)
_EXTENDED_CLASSES: dict[type, type] = {}


class HSDPModule:
    """Methods a module gains from ``fully_shard`` (they act on every unit in its subtree)."""

    def _hsdp_units(self) -> list[HSDPUnitState]:
        return [cell.__dict__["_hsdp_state"] for _, cell in self.cells_and_names()
                if "_hsdp_state" in cell.__dict__]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        if not isinstance(requires_gradient_sync, bool):
            raise InvalidArgumentError(
                f"requires_gradient_sync must be a bool, got {requires_gradient_sync!r}")
        for unit in self._hsdp_units():
            unit.requires_sync = requires_gradient_sync

    def set_reduce_op_type(self, reduce_op_type: str) -> None:
        for unit in self._hsdp_units():
            unit.set_reduce_op(reduce_op_type)

    def zero_grad(self) -> None:
        """Drop accumulated micro-step buckets, reduce outputs and ``main_grad``."""
        for unit in self._hsdp_units():
            unit.zero_grad()

    def unshard(self, async_op: bool = False) -> None:
        """Gather every managed parameter into its cells (until ``reshard()``). The gather is
        synchronous; ``async_op`` is accepted for upstream compatibility."""
        if not isinstance(async_op, bool):
            raise InvalidArgumentError(f"async_op must be a bool, got {async_op!r}")
        for unit in self._hsdp_units():
            unit.unshard()

    def reshard(self) -> None:
        for unit in self._hsdp_units():
            unit.uninstall()


def hsdp_sync_stream() -> None:
    """Wait for every reduction still in flight (a no-op when nothing is). A unit's reductions
    complete inside its backward; what can remain are the pools' fenced buckets."""
    for runtime in all_runtimes():
        runtime.pool.wait_all()


def _validate(modules, mp_policy, offload_policy, reshard_after_forward, comm_fusion,
              pool_config) -> None:
    seen: dict[int, int] = {}
    for position, module in enumerate(modules):
        if id(module) in seen:
            raise InvalidArgumentError(
                f"fully_shard got the same {type(module).__name__} twice in its list (positions "
                f"{seen[id(module)]} and {position}); pass each module once")
        seen[id(module)] = position
        if not isinstance(module, nn.Cell):
            raise InvalidArgumentError(
                f"fully_shard expects an nn.Cell or a list of them, got {type(module).__name__}")
        if "_hsdp_state" in module.__dict__:
            raise InvalidArgumentError(
                f"fully_shard was already applied to this {type(module).__name__}; apply it once "
                "per module (nest by sharding blocks first, then the root)")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise InvalidArgumentError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    if isinstance(offload_policy, CPUOffloadPolicy):
        raise InvalidArgumentError(
            "CPUOffloadPolicy is not supported by this fully_shard; pass OffloadPolicy()")
    if not isinstance(offload_policy, OffloadPolicy):
        raise InvalidArgumentError(f"offload_policy must be an OffloadPolicy, got {offload_policy!r}")
    check_bool("reshard_after_forward", reshard_after_forward)
    check_bool("comm_fusion", comm_fusion)
    if not isinstance(pool_config, GradPoolConfig):
        raise InvalidArgumentError(f"pool_config must be a GradPoolConfig, got {pool_config!r}")


def _validate_mesh(mesh, world: int) -> None:
    if mesh is not None:
        if not isinstance(mesh, DeviceMesh):
            raise InvalidArgumentError(f"mesh must come from init_device_mesh, got {mesh!r}")
        if mesh.ndim != 1:
            raise InvalidArgumentError(
                f"only a 1-D mesh (full sharding) is supported, got mesh_shape {mesh.mesh_shape}")
        if mesh.size() != world:
            raise InvalidArgumentError(
                f"mesh covers {mesh.size()} ranks but the world size is {world}; use a mesh over "
                "all ranks")


def _placement_dim(shard_placement_fn: Optional[Callable], param) -> int:
    if len(param.shape) == 0:
        raise InvalidArgumentError(
            f"parameter {param.name} is 0-d and cannot be sharded; pass it in replicate_params "
            "(kept whole, gradient all-reduced) or ignored_params")
    if shard_placement_fn is None:
        return 0
    try:
        placement = shard_placement_fn(param)
    except Exception as exc:  # noqa: BLE001 - re-raised typed, naming the parameter
        raise InvalidArgumentError(
            f"shard_placement_fn raised {type(exc).__name__} for {param.name}: {exc}") from exc
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise InvalidArgumentError(
            f"shard_placement_fn returned {placement!r} for {param.name}; return Shard(dim) or None")
    dim = placement.dim if placement.dim >= 0 else placement.dim + len(param.shape)
    if not 0 <= dim < len(param.shape):
        raise InvalidArgumentError(
            f"shard_placement_fn returned {placement!r} for {param.name} of shape {param.shape}")
    return dim


def _managed_params(module, ignored: set[int], claimed: set[int]) -> list:
    """(Parameter, [(cell, attribute), ...]) for every trainable parameter of ``module`` that no
    nested unit (nor an earlier module of this call, ``claimed``) manages; a parameter tied into
    several cells is listed once with every owner."""
    found: dict[int, tuple] = {}
    for _, cell in module.cells_and_names():
        for attr, param in list(cell._params.items()):   # pylint: disable=protected-access
            if param is None or id(param) in ignored or id(param) in claimed \
                    or not param.requires_grad or hasattr(param, "hsdp_param"):
                continue
            if hasattr(param, "hsdp_managed_by"):
                raise InvalidArgumentError(
                    f"parameter {param.name} is shared with a module another fully_shard call "
                    "manages; tied parameters must be in one unit (shard their common parent)")
            found.setdefault(id(param), (param, []))[1].append((cell, attr))
    return list(found.values())


def _extend_class(module) -> None:
    cls = type(module)
    if isinstance(module, HSDPModule):
        return
    extended = _EXTENDED_CLASSES.get(cls)
    if extended is None:
        extended = type(f"HSDP{cls.__name__}", (HSDPModule, cls), {})
        _EXTENDED_CLASSES[cls] = extended
    module.__class__ = extended


def fully_shard(module: Union[nn.Cell, list], *, mesh: Optional[DeviceMesh] = None,
                reshard_after_forward: bool = True, shard_placement_fn: Optional[Callable] = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params=None,
                replicate_params=None, comm_fusion: bool = False,
                pool_config: Optional[GradPoolConfig] = None):
    """Shard ``module``'s parameters across the shard group and reduce their gradients through
    gradpool. Mutates and returns ``module`` (a list: each module becomes its own unit)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise InvalidArgumentError("fully_shard got an empty list of modules")
    config = pool_config if pool_config is not None else GradPoolConfig()
    _validate(modules, mp_policy, offload_policy, reshard_after_forward, comm_fusion, config)
    runtime = runtime_for(config)     # after validation: a refused call leaves nothing behind
    _validate_mesh(mesh, runtime.comm.world_size)
    ignored = {id(p) for p in ignored_params or ()}
    replicated = {id(p) for p in replicate_params or ()}
    reducer = runtime.reducer(reduce_dtype=mp_policy.reduce_dtype, comm_fusion=comm_fusion)
    # Plan every module first (every check that can fail, and the shards), then commit: a call
    # that fails leaves every module exactly as it was, so a corrected retry manages everything.
    plans, claimed = [], set()
    for mod in modules:
        params = []
        for param, owners in _managed_params(mod, ignored, claimed):
            is_replicated = id(param) in replicated
            managed = MindSporeHSDPParamV2(
                *owners[0], param, rank=runtime.comm.rank, world_size=runtime.comm.world_size,
                comm=runtime.comm,
                shard_dim=0 if is_replicated else _placement_dim(shard_placement_fn, param),
                replicate=is_replicated, mp_policy=mp_policy,
                verify_gradients=config.verify_gradients)
            managed.owners = owners
            claimed.add(id(param))
            params.append((param, managed))
        plans.append((mod, params))
    for mod, params in plans:
        for param, managed in params:
            managed.adopt(param)
            for cell, attr in managed.owners:
                cell._params[attr] = managed.sharded_param    # pylint: disable=protected-access
        _extend_class(mod)
        mod.__dict__["_hsdp_state"] = HSDPUnitState(mod, [m for _, m in params], reducer,
                                                    mp_policy, reshard_after_forward)
        logger.debug("fully_shard: %s manages %d parameters", type(mod).__name__, len(params))
    return module
