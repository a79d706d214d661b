"""One ``fully_shard`` unit: gathers its parameters before forward, reduces their gradients.

MindSpore 2.10 has no ``Tensor.backward``; training goes through ``ms.value_and_grad``. So the
unit's forward pre-hook passes all its local shards through one custom autograd function: its
forward all-gathers the full parameters (installed as plain attributes that shadow the cells'
``Parameter`` entries), and its backward receives the full gradients from autograd, reduces them
through gradpool, and returns the local shard gradients. ``value_and_grad(fn, None,
module.trainable_params())`` therefore returns the reduced shard gradients directly.

With ``set_requires_gradient_sync(False)`` a backward packs (first micro-step) or accumulates
(later ones) the gradients into the unit's pool buckets and returns zero shard gradients; the
next synchronized backward adds its own gradients and reduces the buckets once.

**Asynchronous reduce** (``main_grad`` mode, ``GradPoolConfig.async_reduce``, the default there).
A unit's backward launches its reduce (reduce-scatter; for HSDP also the replicate all-reduce)
and returns at once, handing autograd shared zeros (one read-only tensor per shape and dtype,
never written: do not write into the gradients ``value_and_grad`` returns). The results are
waited and added into each parameter's float32 ``main_grad`` exactly once, in launch order: when
the unit after the next one launches its reduce (the previous unit's stays in flight behind the
running unit's compute; FSDP2's next reduce-scatter waits on the previous one likewise), the last
two when the backward pass ends (the last thing autograd runs, like FSDP2's final callback), or
earlier by ``hsdp_sync_stream()``, ``zero_grad()`` or the unit's own next backward. So at most two
units' output buckets are leased at once. So when
``value_and_grad`` returns, every ``main_grad`` is final (with ``set_is_last_backward(False)``
only after ``hsdp_sync_stream()``); step the optimizer from ``p.main_grad``.
Without ``main_grad`` the reduce stays synchronous: autograd must get each unit's reduced
shard gradients back from that unit's backward, so the unit has to wait for them there.

How this maps to Ascend streams: every collective is launched with ``async_op=True`` on
MindSpore's communication stream while backward goes on queueing compute. The input bucket goes
back to the pool fenced on the collective's handle, so it is leased again only after the
collective completed. The drain calls ``wait()`` on each handle (MindSpore's ``CommHandle.wait()``
orders the current, compute stream after the collective) before ``main_grad`` is computed from
the output bucket, and only then releases the output bucket. The in-flight memory is bounded by
the pool: at ``max_buckets_in_flight`` fenced input buckets of a dtype, the next ``acquire``
waits for the oldest (a stall, counted in the pool's statistics). HSDP: the replicate all-reduce
reads the reduce-scatter's output, so the reducer waits on the reduce-scatter's handle before it
launches the all-reduce (a stream wait on Ascend; on CPU the host waits): only the all-reduce is
left in flight there.
"""
from __future__ import annotations

import logging
import weakref
from typing import Optional

from gradpool import GatheredParam, GradReducer, check_reduce_op
from hyper_parallel.platform.mindspore.fully_shard.autograd import register_backward_pre_hook
from hyper_parallel.platform.mindspore.fully_shard.order import tag_of, unit_identity
from hyper_parallel.platform.mindspore.fully_shard.order_flag import UnitTag
from hyper_parallel.platform.mindspore.fully_shard.param import MindSporeHSDPParamV2
from hyper_parallel.platform.mindspore.fully_shard.runtime import (RUNTIME, FullyShardRuntime,
                                                                    user_class_name, alive_units)
from hyper_parallel.platform.mindspore.fully_shard.settings import UnitSettings
from hyper_parallel.platform.mindspore.fully_shard.unit_memory import UnitMemory
from hyper_parallel.platform.mindspore.fully_shard.unit_reduce import (AsyncReduceStats,
                                                                        UnitReduce)
from hyper_parallel.platform.mindspore.fully_shard.unit_steps import UnitSteps

logger = logging.getLogger(__name__)

__all__ = ["HSDPUnitState", "AsyncReduceStats", "finish_async_reduces"]


def finish_async_reduces() -> None:
    """Land every asynchronous reduce still in flight (see :class:`FullyShardRuntime`)."""
    RUNTIME.finish_async_reduces()


class HSDPUnitState:
    """One ``fully_shard`` unit: one module, or the modules of one ``fully_shard([a, b, ...])``
    call (gathered together, reduced together). A thin front over its three parts, which the
    runtime, ``HSDPModule`` and the parameters talk to through it:

    * :attr:`memory` (:class:`.unit_memory.UnitMemory`): gathers, prefetches, installs and
      releases the full parameters;
    * :attr:`reduce_path` (:class:`.unit_reduce.UnitReduce`): what a backward does with the
      gradients (reduce, micro-step accumulation, HSDP partials, the asynchronous landing);
    * :attr:`steps` (:class:`.unit_steps.UnitSteps`): the hooks and the per-step state machine.

    The unit drives its parameters (passive records).

    Lifetime: the unit belongs to its modules (``module.__dict__['_hsdp_state']``) and nothing
    else holds it strongly (its modules, its parts, its parameters, other units' prefetch lists
    and the runtime refer to it weakly), so reference counting frees it with its model, the
    garbage collector on or off. A MindSpore ``Parameter`` is freed only by the collector (it and
    its ``ParamInfo`` refer to each other): what a parameter holds must not keep a dropped unit
    alive. When the unit is freed, :func:`_return_leases` gives the pool back every lease it still
    held: micro-step buckets, reduces in flight, gathered parameters, prefetches."""

    def __init__(self, modules: list, params: list[MindSporeHSDPParamV2], reducer: GradReducer,
                 mp_policy, reshard_after_forward: bool, async_reduce: bool = False,
                 runtime: FullyShardRuntime = RUNTIME, world_comm=None,
                 check_unit_order=True):
        """``async_reduce``: leave each backward's reduce in flight (main_grad mode only).
        ``world_comm``: the world, over which a unit-order mismatch is described (the default
        check, carried in the unit's own collectives) or, with ``check_unit_order="strict"``,
        every collective agreed before it runs (:mod:`.order`); None: no check."""
        self._modules = [weakref.ref(module) for module in modules]
        self.runtime = runtime
        self._identity: Optional[int] = None  # set on first use (:meth:`order_identity`)
        self._tags: dict = {}                 # kind -> UnitTag
        self._strict = None
        self._order_on = world_comm is not None
        if world_comm is not None:
            runtime.use_world_comm(world_comm)
            if check_unit_order == "strict":
                self._strict = runtime.unit_order_check(world_comm)
        self.params = params
        self.reducer = reducer
        self.mp_policy = mp_policy
        self.settings = UnitSettings(reshard_after_forward=reshard_after_forward)
        self._is_root: Optional[bool] = None
        self._forward_prefetch: list = []      # weak refs: units gathered when this one is
        # None: the next unit in backward order (implicit); a list: those units (weak refs)
        self._backward_prefetch: Optional[list] = None
        order_tag = _weakly(self.order_tag)
        self.memory = UnitMemory(params, reducer, order_tag)
        self.reduce_path = UnitReduce(params, reducer, mp_policy, self.settings, runtime,
                                      async_reduce, order_tag, owner=self)
        self.steps = UnitSteps(self)
        for param in params:
            param.unit = self       # for upstream's per-parameter calls only (reduce_scatter_grad)
        finalizer = weakref.finalize(self, _return_leases, self.memory, self.reduce_path)
        finalizer.atexit = False    # at exit the pool goes too
        for module in self.modules:
            # a unit without parameters (a root over its units) still marks its forward, so a
            # read of a unit's weight from it gathers the full weight, with or without grad
            module.register_forward_pre_hook(self.steps.pre_forward)
            if params:
                register_backward_pre_hook(module, self.steps.pre_backward)
            module.register_forward_hook(self.steps.post_forward)
            # runs after post_forward, and also when the module's forward raised
            module.register_forward_hook(self.steps.after_forward_call, always_call=True)
        runtime.register(self)

    # -- the unit-order check (:mod:`.order`) ----------------------------------------------------
    @property
    def order_identity(self) -> int:
        """What names this unit alike on every rank: its module path under its root model, its
        class, its parameters' names and shapes (computed at its first collective, when every
        unit of its model exists)."""
        if self._identity is None:
            module = self.modules[0]
            self._identity = unit_identity(self.runtime.path_of(self), user_class_name(module),
                                           [(p.name, p.orig_shape) for p in self.params])
        return self._identity

    def order_tag(self, kind: int, agree: bool = True):
        """The tag this unit's collective ``kind`` carries (None: no check, or strict mode, which
        agrees over the world here, before the collective, when ``agree``)."""
        if not self._order_on:
            return None
        if self._strict is not None:
            if agree:
                self._strict.agree(tag_of(self.order_identity, kind))
            return None
        tag = self._tags.get(kind)
        if tag is None:
            tag = self._tags[kind] = UnitTag(self.runtime.order_flag,
                                             tag_of(self.order_identity, kind))
        return tag

    def forget_order_tags(self) -> None:
        """The runtime replaced its order flag: tags are made anew on it."""
        self._tags = {}

    # -- what the runtime and other units ask -----------------------------------------------------
    @property
    def modules(self) -> list:
        return [module for module in (ref() for ref in self._modules) if module is not None]

    @property
    def forward_prefetch(self) -> list:
        return alive_units(self._forward_prefetch)

    @forward_prefetch.setter
    def forward_prefetch(self, units: list) -> None:
        self._forward_prefetch = [weakref.ref(unit) for unit in units]

    @property
    def backward_prefetch(self) -> Optional[list]:
        return None if self._backward_prefetch is None else alive_units(self._backward_prefetch)

    @backward_prefetch.setter
    def backward_prefetch(self, units: Optional[list]) -> None:
        self._backward_prefetch = None if units is None else [weakref.ref(u) for u in units]

    @property
    def module(self):
        return self.modules[0]

    @property
    def is_root(self) -> bool:
        """No other unit's module contains this unit's modules (its backward runs last). Known
        once a forward has run: units are all built by then."""
        if self._is_root is None:
            self._is_root = not any(other.contains(self) for other in self.runtime.live_units()
                                    if other is not self)
        return self._is_root

    def contains(self, other: "HSDPUnitState") -> bool:
        """One of this unit's modules has one of ``other``'s modules strictly inside it."""
        theirs = {id(m) for m in other.modules}
        return any(theirs & ({id(cell) for _, cell in module.cells_and_names()} - {id(module)})
                   for module in self.modules)

    @property
    def in_forward(self) -> bool:
        """A forward use of this unit is under way (its parameters gathered and installed)."""
        return self.steps.gathered

    @property
    def in_backward_use(self) -> bool:
        """This unit's backward pre-hook ran and its backward has not."""
        return self.steps.in_backward_use

    @property
    def reshards_after_forward(self) -> bool:
        """This unit frees its gathered parameters when its forward ends (a root keeps them:
        its backward follows at once)."""
        return self.settings.reshard_after_forward and not self.is_root

    @property
    def async_stats(self) -> AsyncReduceStats:
        return self.reduce_path.async_stats

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered-parameter memory this unit holds now."""
        return self.memory.gathered_bytes

    @property
    def buffers(self) -> list[Optional[GatheredParam]]:
        return self.memory.buffers

    def needs_gather(self) -> bool:
        """Some gathered parameter of this unit was released and not gathered again."""
        return self.memory.needs_gather()

    def prefetch(self) -> None:
        self.steps.prefetch()

    def prefetch_for_backward(self) -> None:
        self.memory.prefetch_for_backward()

    def abandon_prefetch(self) -> None:
        self.memory.abandon_prefetch()

    def settle_backward(self) -> None:
        self.steps.settle_backward()

    def reset_after_failure(self) -> None:
        self.steps.reset_after_failure()

    def finish_async_reduce(self) -> None:
        self.reduce_path.finish_async_reduce()

    def read_outside(self, param: MindSporeHSDPParamV2):
        return self.steps.read_outside(param)

    def reduce(self, params: list[MindSporeHSDPParamV2], op: str) -> None:
        """The unit's one reduce path, for ``params`` (upstream's per-parameter calls)."""
        self.reduce_path.reduce(params, op)

    # -- HSDPModule's controls --------------------------------------------------------------------
    def unshard(self) -> None:
        self.memory.install(self.memory.gather(self.memory.local_params()))

    def reshard(self) -> None:
        """Drop what ``unshard()`` installed and release the gathered memory."""
        self.memory.uninstall()
        self.memory.release()

    def uninstall(self) -> None:
        self.memory.uninstall()

    def set_reduce_op(self, op: str) -> None:
        check_reduce_op(op)
        self.settings.reduce_op = op
        self.settings.gradient_divide_factor = None

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Checked by ``HSDPModule.set_gradient_divide_factor``."""
        self.settings.gradient_divide_factor = factor

    def zero_grad(self) -> None:
        """Drop this unit's gradients; reduces still in flight (any unit's, in launch order) are
        waited first, so none lands after the zeroing or is lost in flight. A grad graph an
        exception left open is closed here, between steps."""
        self.runtime.close_abandoned_grad_graph()
        try:
            self.runtime.finish_async_reduces()
        finally:
            self.reduce_path.zero_grad()


def _weakly(method):
    """``method`` (bound to a unit) called through a weak reference: a part of the unit holding
    it does not keep the unit alive (a dropped unit's call does nothing and gives None)."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        bound = ref()
        return None if bound is None else bound(*args)
    return call


def _return_leases(memory: UnitMemory, reduce_path: UnitReduce) -> None:
    """A unit was freed (its model dropped, maybe between micro-steps or after an exception):
    every lease it still held goes back to the pool (an output bucket whose collective is still
    running goes back fenced on it). Its gradients are dropped, not landed. A finalizer cannot
    raise to anyone: a failure is logged."""
    try:
        try:
            memory.abandon_prefetch()
            memory.uninstall()
            memory.release()
        finally:
            reduce_path.drop_everything()
    except Exception:  # noqa: BLE001 - nobody to raise to
        logger.exception("fully_shard: returning the leases of a dropped unit failed")
