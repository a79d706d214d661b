"""``fully_shard``: the upstream-compatible entry point, with every gradient reduced on pool memory.

Pool options reach ``fully_shard`` through the keyword-only ``pool_config=`` argument, a
:class:`gradpool.GradPoolConfig` (zero-copy, poison-on-release, bucket cap, alignment,
buckets in flight, cache cap, gradient verification, asynchronous reduce). Calls written for
upstream pass none and get the process default: ``GradPoolConfig()`` unless
:func:`gradpool.set_default_pool_config` set another (how a framework that calls
``fully_shard`` itself, such as mindformers, gets ``verify_gradients``).

With ``MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)`` the reduce is asynchronous by
default (``GradPoolConfig.async_reduce``): each unit's backward only launches it, each result
is added into ``main_grad`` when the unit after the next one launches its reduce (the last two
at the end of backward), and the gradients ``value_and_grad`` returns
for managed parameters are (shared) zeros: feed the optimizer from ``p.main_grad``. See the
platform state module for the ordering on Ascend.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Optional, Union

from mindspore import nn

from gradpool import (GradPoolConfig, InvalidArgumentError, all_runtimes, check_bool,
                      default_pool_config, device_target, on_real_device,
                      real_device_target, return_free_host_memory, runtime_for)
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.dtensor import as_managed_dtensor
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.dtensor.spec import fully_shard_spec
from hyper_parallel.core.fully_shard.state_dict import (get_model_state_dict,
                                                        get_optimizer_state_dict,
                                                        set_model_state_dict,
                                                        set_optimizer_state_dict)
from hyper_parallel.core.fully_shard.utils import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                   OffloadPolicy)
from hyper_parallel.platform.mindspore.fully_shard.autograd import grad_recorded, in_backward
from hyper_parallel.platform.mindspore.fully_shard.meta_init import refuse_meta_at_forward
from hyper_parallel.platform.mindspore.fully_shard.param import MindSporeHSDPParamV2
from hyper_parallel.platform.mindspore.fully_shard.state import (HSDPUnitState,
                                                                  finish_async_reduces)

__all__ = ["fully_shard", "HSDPModule", "hsdp_sync_stream", "MixedPrecisionPolicy",
           "OffloadPolicy", "CPUOffloadPolicy", "get_model_state_dict", "set_model_state_dict",
           "get_optimizer_state_dict", "set_optimizer_state_dict"]
logger = logging.getLogger(__name__)
_EXTENDED_CLASSES: dict = {}     # class (or (ShardedReads, class)) -> its extended class


class _Unsharded:
    """What ``unshard(async_op=True)`` returns: the gather ran when it was called (MindSpore 2.10
    gathers synchronously here), so ``wait()`` has nothing left to wait for."""

    def wait(self) -> None:
        return None


class ShardedReads:
    """What a cell holding a ``fully_shard``-managed parameter gains: reading that parameter
    while its unit is not running, inside a forward (``self.embed.weight`` in a root: a tie
    across units), gathers it as a use of its unit instead of handing out the local shard.
    Outside any forward (inspection, initialisation) the attribute is the local shard
    ``Parameter``, as ``trainable_params()`` lists it."""

    def __getattr__(self, name):
        managed = self.__dict__.get("_hsdp_reads", {}).get(name)
        if managed is not None and _reading_in_a_forward(managed.unit.runtime):
            return managed.unit.read_outside(managed)
        return super().__getattr__(name)


def _reading_in_a_forward(runtime) -> bool:
    return grad_recorded() or in_backward() or any(u.in_forward for u in runtime.live_units())


def _guard_reads(cell, attr: str, managed) -> None:
    cls = type(cell)
    if not isinstance(cell, ShardedReads):
        extended = _EXTENDED_CLASSES.get((ShardedReads, cls))
        if extended is None:
            # the same name: messages and reprs name the user's class
            extended = type(cls.__name__, (ShardedReads, cls), {})
            _EXTENDED_CLASSES[(ShardedReads, cls)] = extended
        cell.__class__ = extended
    cell.__dict__.setdefault("_hsdp_reads", {})[attr] = managed


class HSDPModule:
    """Methods a module gains from ``fully_shard`` (they act on every unit in its subtree)."""

    def _hsdp_units(self) -> list[HSDPUnitState]:
        units: dict[int, HSDPUnitState] = {}
        for _, cell in self.cells_and_names():
            unit = cell.__dict__.get("_hsdp_state")
            if unit is not None:
                units.setdefault(id(unit), unit)     # a list unit sits on each of its modules
        return list(units.values())

    def _set_all(self, name: str, attribute: str, value) -> None:
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
        for unit in self._hsdp_units():
            setattr(unit.settings, attribute, value)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: micro-steps accumulate in the unit's pool buckets, no collective runs."""
        self._set_all("requires_gradient_sync", "requires_sync", requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool) -> None:
        """HSDP: False skips the replicate-group all-reduce after each reduce-scatter, so each
        replica keeps its own shard gradient (all-reduced later, e.g. on the last micro-step)."""
        self._set_all("requires_all_reduce", "requires_all_reduce", requires_all_reduce)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """True (default): the root unit's backward ends the step: it waits for every collective
        still in flight (``hsdp_sync_stream``: asynchronous reduces land in ``main_grad``, fenced
        buckets are recycled) before it returns; False leaves them in flight (more micro-batches
        follow: each unit's next backward, ``zero_grad()`` or ``hsdp_sync_stream()`` lands them)."""
        self._set_all("is_last_backward", "is_last_backward", is_last_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """True (the default): when the unit's forward ends, the memory of its gathered full
        parameters goes back (storage resized to 0, in buffers the unit made); before its
        backward they are gathered again into the same buffers, so a rank holds the gathered
        parameters of at most the running unit and the one prefetched. A root unit keeps its
        own (its backward follows at once, as in FSDP2). False: kept from forward to backward.
        Values are bit-identical either way."""
        self._set_all("reshard_after_forward", "reshard_after_forward", reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool) -> None:
        """True (default): gathered parameters installed by ``unshard()`` are dropped when the
        unit's backward ends; False keeps them installed until ``reshard()``."""
        self._set_all("reshard_after_backward", "reshard_after_backward", reshard_after_backward)

    def set_gradient_scaling_factor(self, factor: float) -> None:
        """Multiply each reduced gradient by ``factor`` (upstream's use: reduce with "sum" and
        scale by 1/N instead of averaging)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not math.isfinite(factor) or factor <= 0:
            raise InvalidArgumentError(f"gradient scaling factor must be a finite number > 0, got "
                             f"{factor!r}")
        for unit in self._hsdp_units():
            unit.settings.gradient_scaling_factor = float(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide each reduced gradient by ``factor`` instead of by the group size (FSDP2's
        name): the unit's reduce-scatter (and, HSDP, its replicate all-reduce) then sums, and
        the sum is divided by ``factor``. ``set_reduce_op_type("avg")`` is the divide factor of
        the whole group (shard x replicate size), ``"sum"`` that of 1; whichever of the two
        calls came last decides. ``gradient_scaling_factor`` still multiplies afterwards.

        Its use: an expert unit reduced over the W/E ranks holding the same experts, whose
        local gradients the token dispatcher already summed over the E ranks of its EP group,
        sets W, so expert gradients average over the same global batch as dense ones."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not math.isfinite(factor) or factor <= 0:
            raise InvalidArgumentError(f"gradient divide factor must be a finite number > 0, got "
                                       f"{factor!r}")
        for unit in self._hsdp_units():
            unit.set_gradient_divide_factor(float(factor))

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """When this module's unit starts its forward (right after its own all-gather), launch
        the all-gathers of ``modules``' units asynchronously, so their parameters are ready
        (or in flight) when those modules run; they then wait instead of gathering. A
        prefetched gather no forward used is given back at the end of the step's backward."""
        self._unit().forward_prefetch = self._prefetch_units("set_modules_to_forward_prefetch",
                                                             modules)

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """The units whose gather this unit's backward launches before it computes (default:
        the next unit in backward order, the previous one in forward order; ``[]`` turns
        prefetch off). Only units that reshard after forward are gathered again."""
        self._unit().backward_prefetch = self._prefetch_units("set_modules_to_backward_prefetch",
                                                              modules)

    def _unit(self) -> HSDPUnitState:
        return self.__dict__["_hsdp_state"]

    @staticmethod
    def _prefetch_units(name: str, modules) -> list:
        if not isinstance(modules, list):
            raise InvalidArgumentError(
                f"{name} takes a list of fully_shard modules, got {type(modules).__name__} "
                f"{modules!r}")
        units = []
        for position, module in enumerate(modules):
            if not isinstance(module, HSDPModule):
                raise InvalidArgumentError(
                    f"{name}: entry {position} is a {type(module).__name__}, not a module "
                    "fully_shard was applied to; apply fully_shard to it first")
            units.append(module.__dict__["_hsdp_state"])
        return units

    def set_reduce_op_type(self, reduce_op_type: str) -> None:
        """"avg" (default): reduced gradients are divided by the group size; "sum": not
        divided. Replaces an earlier ``set_gradient_divide_factor``."""
        for unit in self._hsdp_units():
            unit.set_reduce_op(reduce_op_type)

    def zero_grad(self) -> None:
        """Drop accumulated micro-step buckets, reduce outputs and ``main_grad``; reduces still in
        flight are waited first (so none lands after it)."""
        for unit in self._hsdp_units():
            unit.zero_grad()

    def unshard(self, async_op: bool = False):
        """Gather every managed parameter into its cells (until ``reshard()``, or the end of the
        unit's next backward). With ``async_op=True`` returns a handle with ``wait()``.

        The cells then read the full tensors; ``trainable_params()`` still lists the local
        shards (MindSpore 2.10's optimizers hold those Parameter objects), unlike upstream."""
        if not isinstance(async_op, bool):
            raise InvalidArgumentError(f"async_op must be a bool, got {async_op!r}")
        for unit in self._hsdp_units():
            unit.unshard()
        return _Unsharded() if async_op else None

    def reshard(self) -> None:
        """Drop the full parameters ``unshard()`` (or a forward without gradients, e.g. an
        evaluation pass) left gathered: uninstalled from the cells and their memory released."""
        for unit in self._hsdp_units():
            unit.reshard()
        if device_target() == "CPU":
            return_free_host_memory()    # the C allocator keeps freed host pages otherwise

    def to_empty(self, *, device: Optional[str] = None, recurse: bool = True):
        """Give every parameter and buffer uninitialised memory (``Cell.to_empty``); each
        ``fully_shard``-managed parameter gets its local shard's, never the full parameter's.
        ``device`` None: the process's real device, also inside ``ms.DeviceCtx("meta")``
        (MindSpore 2.10's own ``to_empty()`` keeps a meta tensor on meta)."""
        return super().to_empty(device=device or real_device_target(), recurse=recurse)


def hsdp_sync_stream() -> None:
    """Wait for every reduction still in flight (a no-op when nothing is): asynchronous reduces
    (main_grad mode) are waited and added into ``main_grad``, in launch order, and the pools'
    fenced buckets recycled. A collective that failed is raised here, after the rest settled."""
    try:
        finish_async_reduces()
    finally:
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


def _mesh_comms(mesh: Optional[DeviceMesh], runtime):
    """(shard communicator, replicate communicator or None) of ``mesh`` for this rank: a 1-D
    mesh shards over its ranks; a 2-D one replicates over dim 0 and shards over dim 1."""
    if mesh is None:
        return runtime.comm, None
    if not isinstance(mesh, DeviceMesh):
        raise InvalidArgumentError(f"mesh must come from init_device_mesh, got {mesh!r}")
    if mesh.ndim not in (1, 2):
        raise InvalidArgumentError(
            f"fully_shard takes a 1-D mesh (shard) or a 2-D one (replicate, shard), got a "
            f"{mesh.ndim}-D mesh_shape {mesh.mesh_shape}")
    world = runtime.comm.world_size
    if max(mesh.ranks) >= world:
        raise InvalidArgumentError(
            f"mesh covers {mesh.size()} ranks but the world size is {world}; its ranks "
            f"{mesh.ranks} must exist")
    if runtime.comm.rank not in mesh.ranks:
        raise InvalidArgumentError(
            f"rank {runtime.comm.rank} is not in {mesh!r}; apply fully_shard with a mesh that "
            "holds this rank")
    if mesh.ndim == 1:
        return runtime.group_comm(mesh.get_group(0)), None
    return runtime.group_comm(mesh.get_group(1)), runtime.group_comm(mesh.get_group(0))


def _world_mesh(runtime) -> DeviceMesh:
    """The 1-D mesh of every rank: what a unit without a mesh shards over."""
    from gradpool import device_target
    target = device_target()
    return DeviceMesh(target if target in ("CPU", "Ascend") else "cpu", (runtime.comm.world_size,))


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
    gradpool. Mutates and returns ``module``; a list of modules becomes one unit.

    ``mesh``: None shards over every rank; a 1-D mesh (it may be a sub-mesh: a part of the
    world) shards over its ranks; a 2-D mesh replicates over dim 0 and shards over dim 1 (HSDP:
    reduce-scatter in the shard group, then all-reduce in the replicate group, both on pool
    memory)."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise InvalidArgumentError("fully_shard got an empty list of modules")
    # Called inside ms.DeviceCtx("meta") (mindformers' apply_fsdp always is), the pool, the
    # communicators, main_grad and the shards of real parameters still go to the real device;
    # meta parameters get meta shards (meta_init), given memory by to_empty().
    with on_real_device():
        return _fully_shard(modules, module, mesh, reshard_after_forward, shard_placement_fn,
                            mp_policy, offload_policy, ignored_params, replicate_params,
                            comm_fusion, pool_config)


def _fully_shard(modules, module, mesh, reshard_after_forward, shard_placement_fn, mp_policy,
                 offload_policy, ignored_params, replicate_params, comm_fusion, pool_config):
    config = pool_config if pool_config is not None else default_pool_config()
    _validate(modules, mp_policy, offload_policy, reshard_after_forward, comm_fusion, config)
    runtime = runtime_for(config)     # after validation: a refused call leaves nothing behind
    shard_comm, replicate_comm = _mesh_comms(mesh, runtime)
    ignored = {id(p) for p in ignored_params or ()}
    replicated = {id(p) for p in replicate_params or ()}
    reducer = runtime.reducer(reduce_dtype=mp_policy.reduce_dtype, comm_fusion=comm_fusion,
                              comm=shard_comm, replicate_comm=replicate_comm)
    # Plan every module first (every check that can fail, and the shards), then commit: a call
    # that fails leaves every module exactly as it was, so a corrected retry manages everything.
    params, claimed = [], set()
    for mod in modules:
        for param, owners in _managed_params(mod, ignored, claimed):
            is_replicated = id(param) in replicated
            managed = MindSporeHSDPParamV2(
                *owners[0], param, rank=shard_comm.rank, world_size=shard_comm.world_size,
                comm=shard_comm,
                shard_dim=0 if is_replicated else _placement_dim(shard_placement_fn, param),
                replicate=is_replicated, mp_policy=mp_policy,
                verify_gradients=config.verify_gradients,
                main_grad_in_place=config.main_grad_in_place)
            managed.owners = owners
            claimed.add(id(param))
            params.append((param, managed))
    layout_mesh = mesh if mesh is not None else _world_mesh(runtime)
    for param, managed in params:
        managed.adopt(param)
        # The shard (and its main_grad) become DTensors: placements over the unit's mesh.
        as_managed_dtensor(managed.sharded_param, fully_shard_spec(
            layout_mesh, managed.orig_shape, managed.shard_dim, managed.replicate))
        for cell, attr in managed.owners:
            cell._params[attr] = managed.sharded_param    # pylint: disable=protected-access
            _guard_reads(cell, attr, managed)
    refuse_meta_at_forward(modules, [m for _, m in params])     # runs before the unit's hooks
    # A list is one unit, as upstream: one gather and one reduce per step for all its modules.
    unit = HSDPUnitState(modules, [m for _, m in params], reducer, mp_policy,
                         reshard_after_forward,
                         async_reduce=config.async_reduce and mp_policy.apply_grad_on_fp32_main_grad,
                         world_comm=runtime.comm if config.check_unit_order else None,
                         check_unit_order=config.check_unit_order)
    if params:
        unit.runtime.replaced_parameters = True     # the originals are freed before a forward
    for mod in modules:
        _extend_class(mod)
        mod.__dict__["_hsdp_state"] = unit
    logger.debug("fully_shard: %s manage %d parameters", [type(m).__name__ for m in modules],
                 len(params))
    return module
