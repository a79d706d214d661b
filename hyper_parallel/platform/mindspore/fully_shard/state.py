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
waited and added into each parameter's float32 ``main_grad`` exactly once, in launch order, when
the root unit's backward ends (the last thing autograd runs, like FSDP2's final callback) or
earlier by ``hsdp_sync_stream()``, ``zero_grad()`` or the unit's own next backward. So when
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
from dataclasses import dataclass
from typing import Optional

import mindspore as ms
from mindspore import mint
from mindspore.common._grad_function import _Function

from gradpool import (SUPPORTED_DTYPES, GatheredParam, GradReducer, LeaseStateError,
                      PackedBucket, UnsupportedPatternError, check_reduce_op)
from hyper_parallel.platform.mindspore.fully_shard.autograd import (grad_recorded, in_backward,
                                                                     replaying_forward)
from hyper_parallel.platform.mindspore.fully_shard.param import (MindSporeHSDPParamV2,
                                                                  PendingGather,
                                                                  launch_all_gather)
from hyper_parallel.platform.mindspore.fully_shard.runtime import RUNTIME, FullyShardRuntime
from hyper_parallel.platform.mindspore.fully_shard.order import GATHER, REDUCE

logger = logging.getLogger(__name__)


def finish_async_reduces() -> None:
    """Land every asynchronous reduce still in flight (see :class:`FullyShardRuntime`)."""
    RUNTIME.finish_async_reduces()


@dataclass
class AsyncReduceStats:
    """Counters of one unit's asynchronous reduces."""

    launched: int = 0            # backwards that left their reduce in flight
    returned_in_flight: int = 0  # ... whose collective had not completed when the backward returned
    finished: int = 0            # reduces waited and added into main_grad


def _make_gather_function(unit: "HSDPUnitState"):
    class UnitGather(_Function):
        @staticmethod
        def forward(ctx, *local_params):
            return unit.gather(local_params)

        @staticmethod
        def backward(ctx, *grads):
            return unit.on_backward(grads)

    return UnitGather


class HSDPUnitState:
    """Parameters, hooks and pending reductions of one ``fully_shard`` unit: one module, or the
    modules of one ``fully_shard([a, b, ...])`` call (gathered together, reduced together).

    The unit drives its parameters (passive records): it gathers them, frees the gathered memory
    after forward, gathers it again before backward, launches the reduce and drains it.

    Parameter memory across a step (``reshard_after_forward=True``, every unit but a root):

    * forward: the pre-forward hook gathers the unit's parameters into its
      :class:`gradpool.GatheredParam` buffers (or waits on a forward prefetch); the forward
      hook, once every module of the unit ran, releases their memory. Autograd keeps the tensor
      objects, not their bytes.
    * backward: the backward pre-hook (it runs when the gradient of the unit's output is ready,
      before the unit's own ops' backward) gathers them again into the same tensors, without
      bumping their version, then launches the all-gather of the next unit in backward order
      (the one whose forward ended just before, or ``set_modules_to_backward_prefetch``'s),
      so it runs while this unit computes. The unit's backward (the gather function's) reduces
      the gradients and, with ``reshard_after_backward`` (default), releases the memory again.

    So a rank holds the gathered parameters of the running unit, of at most one prefetched unit,
    and of the root (which keeps its parameters from forward to backward, as in FSDP2, since its
    backward starts right after its forward ends)."""

    def __init__(self, modules: list, params: list[MindSporeHSDPParamV2], reducer: GradReducer,
                 mp_policy, reshard_after_forward: bool, async_reduce: bool = False,
                 runtime: FullyShardRuntime = RUNTIME, world_comm=None):
        """``async_reduce``: leave each backward's reduce in flight (main_grad mode only).
        ``world_comm``: every rank agrees on each collective of this unit over it before the
        collective runs (:mod:`.order`); None: no agreement."""
        self.modules = list(modules)
        self.runtime = runtime
        self.index = -1                       # set by runtime.register
        self._order = None if world_comm is None else runtime.unit_order_check(world_comm)
        self.async_reduce = async_reduce
        self.async_stats = AsyncReduceStats()
        self.params = params
        self.reducer = reducer
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_sync = True
        self.requires_all_reduce = True
        self.is_last_backward = True
        self.gradient_scaling_factor = 1.0
        self.reduce_op = "avg"
        self.gradient_divide_factor: Optional[float] = None   # set: sum, then divide by it
        self._pending: Optional[tuple[list[PackedBucket], list[PackedBucket]]] = None
        self._gather = _make_gather_function(self)
        # Per-step state (one reset path: settle_backward at the end of each backward pass,
        # reset_after_failure when a forward raised):
        self._forwarded: set[int] = set()     # modules of this unit run since the last gather
        self._post_ran: set[int] = set()      # modules whose post-forward hook ran this call
        self._gathered = False                # a forward use is under way (gathered, installed)
        self._in_backward = False             # the backward pre-hook ran, the backward has not
        self.uses_awaiting_backward = 0       # recorded forward uses whose backward has not run
        self._outside_uses = 0                # ... of them, reads from outside the unit
        self._installed_for_backward = False  # the backward pre-hook installed the gathered
        self._recompute_checked = False       # reentrant Cell.recompute() switched (first use)
        self._is_root: Optional[bool] = None
        self.forward_prefetch: list["HSDPUnitState"] = []     # units gathered when this one is
        # None: the next unit in backward order (implicit); a list: those units
        self.backward_prefetch: Optional[list["HSDPUnitState"]] = None
        self._prefetched: Optional[PendingGather] = None
        # One per parameter: the memory of its gathered form (None: nothing to gather, the local
        # parameter is the full one: replicated, or a shard group of one rank). Made lazily.
        self._buffers: list[Optional[GatheredParam]] = [None] * len(params)
        self._poison = reducer.pool.poison_on_release
        for param in params:
            param.unit = self       # for upstream's per-parameter calls only (reduce_scatter_grad)
        for module in self.modules:
            if params:
                module.register_forward_pre_hook(self._pre_forward)
                module.register_backward_pre_hook(self._pre_backward)
            module.register_forward_hook(self._post_forward)
            # runs after _post_forward, and also when the module's forward raised
            module.register_forward_hook(self._after_forward_call, always_call=True)
        runtime.register(self)

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
        return self._gathered

    @property
    def in_backward_use(self) -> bool:
        """This unit's backward pre-hook ran and its backward has not."""
        return self._in_backward

    @property
    def reshards_after_forward(self) -> bool:
        """This unit frees its gathered parameters when its forward ends (a root keeps them:
        its backward follows at once)."""
        return self.reshard_after_forward and not self.is_root

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered-parameter memory this unit holds now."""
        return sum(b.resident_bytes for b in self._buffers if b is not None)

    @property
    def buffers(self) -> list[Optional[GatheredParam]]:
        return list(self._buffers)

    # -- forward ----------------------------------------------------------------------------------
    def _pre_forward(self, cell, inputs):
        self.runtime.free_replaced_parameters()
        if replaying_forward():
            self._prepare_recompute()
        elif in_backward():
            self._refuse_reentrant_recompute(cell)
        elif not self._gathered:
            self._begin_forward_use()
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            return tuple(_cast_floating(x, dtype) for x in inputs)
        return None

    def _begin_forward_use(self) -> None:
        """One use of the unit starts: one gather for the whole unit, at the first of its
        modules to run, so its backward receives every module's gradients at once. A unit run
        again in the same forward (weight reuse) gathers again: each use is its own autograd
        node, whose backward reduces that use's gradients (autograd sums the uses)."""
        self.runtime.recover_from_failed_backward()
        if not self._recompute_checked:
            self.runtime.check_recompute_cells(self)
            self._recompute_checked = True
        fulls = self._gather.apply(*[p.sharded_param for p in self.params])
        if not isinstance(fulls, (tuple, list)):
            fulls = (fulls,)
        self._install(fulls)
        self._gathered = True
        self._in_backward = False
        if grad_recorded():
            self.uses_awaiting_backward += 1
        for unit in self.forward_prefetch:
            unit.prefetch()

    def _refuse_reentrant_recompute(self, cell) -> None:
        """A forward inside backward that is not a non-reentrant replay: MindSpore's reentrant
        recompute (``mindspore.recompute(cell, ...)`` with its default ``use_reentrant=True``, or
        ``Cell.recompute()`` on a cell around this unit) re-running the cell under a nested grad
        of that cell's own Parameters, the local shards: the gathered parameters the cell
        computes with would get no gradient."""
        self.runtime.restore_cell_grad_flags()
        raise UnsupportedPatternError(
            f"fully_shard: {type(cell).__name__} (a module of the unit "
            f"{[type(m).__name__ for m in self.modules]}) was run again inside backward by "
            "MindSpore's reentrant recompute, whose nested grad cannot reach the parameters the "
            "unit gathers; use mindspore.recompute(..., use_reentrant=False), Cell.recompute() "
            "on a cell inside the unit, or hyper_parallel.core.activation_checkpoint.checkpoint")

    def _prepare_recompute(self) -> None:
        """A forward run inside backward (activation recompute): the cells read the gathered
        parameters this backward holds (gathered again only if released: the backward pre-hook
        or a prefetch usually did it), and nothing is gathered as a new use, resharded or
        prefetched: the recomputed forward only rebuilds activations, and autograd sends its
        gradients through the original use's gather."""
        if self.needs_gather():
            self.gather([p.sharded_param for p in self.params])
        self._install_for_backward()

    def _current_fulls(self) -> tuple:
        """The gathered parameters as they are now (a parameter without a buffer is its own full
        form)."""
        return tuple(p.in_param_dtype(p.sharded_param) if b is None else b.tensor
                     for p, b in zip(self.params, self._buffers))

    def _install_for_backward(self) -> None:
        if not self._installed():
            self._install(self._current_fulls())
            self._installed_for_backward = True

    def _installed(self) -> bool:
        return any(attr in cell.__dict__ for p in self.params for cell, attr in p.owners)

    def _post_forward(self, cell, inputs, outputs):
        self._post_ran.add(id(cell))
        if not replaying_forward():   # a recomputed forward keeps all for the backward under way
            self._end_forward_module(cell)
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return None
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(_cast_floating(x, dtype) for x in outputs)
        return _cast_floating(outputs, dtype)

    def _end_forward_module(self, cell) -> None:
        self._forwarded.add(id(cell))
        if len(self._forwarded) == len(self.modules):      # every module of the unit has run
            self._forwarded.clear()
            self._gathered = False
            if self.reshard_after_forward:
                self.uninstall()
            if self.params:
                self.runtime.forward_ended(self)
                # a forward run inside backward (a reentrant recompute's inner forward) is
                # followed at once by its own backward: keep the memory for it
                # nor while a read from outside the unit awaits its backward (no backward
                # pre-hook gathers for it)
                if self.reshards_after_forward and not in_backward() and not self._outside_uses:
                    self.release_gathered()

    def _after_forward_call(self, cell, inputs, outputs):
        """Runs after every forward of one of the unit's modules, also one that raised (then
        ``_post_forward`` did not run): a failed forward resets every unit of the process."""
        if id(cell) in self._post_ran:
            self._post_ran.discard(id(cell))
            return None
        if not in_backward():      # a recompute's early stop raises by design, inside backward
            self.runtime.reset_after_failed_forward(cell)
        return None

    def read_outside(self, param: MindSporeHSDPParamV2) -> ms.Tensor:
        """``param`` read by a cell while its unit is not running (a root computing with a
        child's weight: a tie across units): the unit is gathered for this read as one more use
        of it, so the read sees the full parameter and its gradient reaches this unit's reduce
        (and ``main_grad``) through the use's own backward; the memory stays until then."""
        index = self.params.index(param)
        if replaying_forward():
            self._prepare_recompute()
            return self._current_fulls()[index]
        fulls = self._gather.apply(*[p.sharded_param for p in self.params])
        if not isinstance(fulls, (tuple, list)):
            fulls = (fulls,)
        if grad_recorded():
            self.uses_awaiting_backward += 1
            self._outside_uses += 1
        return fulls[index]

    def reset_after_failure(self) -> None:
        """Back to rest after a forward that raised: no use awaits a backward, nothing is
        installed or gathered, no prefetch is pending. Gradients already reduced or accumulated
        (micro-steps before the failure) are kept."""
        self._forwarded.clear()
        self._post_ran.clear()
        self._gathered = False
        self._in_backward = False
        self.uses_awaiting_backward = 0
        self._outside_uses = 0
        self._installed_for_backward = False
        self.abandon_prefetch()
        self.uninstall()
        self.release_gathered()

    def _install(self, fulls) -> None:
        for param, full in zip(self.params, fulls):
            # An instance attribute is found before Cell.__getattr__ looks in _params, so the
            # cell's construct reads the gathered tensor while trainable_params() stays sharded.
            for cell, attr in param.owners:
                cell.__dict__[attr] = full

    def uninstall(self) -> None:
        for param in self.params:
            for cell, attr in param.owners:
                cell.__dict__.pop(attr, None)

    def unshard(self) -> None:
        self._install(self.gather([p.sharded_param for p in self.params]))

    def reshard(self) -> None:
        """Drop what ``unshard()`` installed and release the gathered memory."""
        self.uninstall()
        self.release_gathered()

    def gather(self, local_params) -> tuple:
        """The unit's full parameters, in its gathered buffers: with ``comm_fusion`` one
        all-gather per dtype into pool buckets (``param.launch_all_gather``), else one per
        parameter; ``comm_fusion`` governs both directions, as upstream. A gather another unit
        prefetched is waited."""
        pending, self._prefetched = self._prefetched, None
        if pending is None:
            pending = self._launch_gather(local_params)
        return pending.wait(self._fill)

    def _fill(self, index: int, full: ms.Tensor) -> ms.Tensor:
        """Entry ``index`` of a gather: written into that parameter's buffer, whose tensor is what
        the cells compute with (a gather straight into the buffer has filled it already); a
        parameter with nothing to gather is its own full form (no buffer, never released)."""
        buffer = self._buffer(index)
        if buffer is None or full is buffer.tensor:
            return full
        return buffer.fill(full)

    def _buffer(self, index: int) -> Optional[GatheredParam]:
        """Parameter ``index``'s gathered memory, made on first use; None when it has nothing to
        gather."""
        param = self.params[index]
        if param.replicate or param.world_size == 1:
            return None
        if self._buffers[index] is None:
            self._buffers[index] = GatheredParam(
                param.orig_shape, param.param_dtype or param.orig_dtype, poison=self._poison)
        return self._buffers[index]

    def release_gathered(self) -> None:
        """Release the memory of every gathered parameter of this unit (the one release path
        for it: :meth:`gradpool.GatheredParam.release`, on buffers this unit made)."""
        for buffer in self._buffers:
            if buffer is not None:
                buffer.release()

    def needs_gather(self) -> bool:
        """Some gathered parameter of this unit was released and not gathered again."""
        return any(b is not None and not b.valid for b in self._buffers)

    def _agree(self, kind: int) -> None:
        if self._order is not None:
            self._order.agree(self.index, kind)

    def _launch_gather(self, local_params) -> PendingGather:
        self._agree(GATHER)
        return launch_all_gather(self.params, list(local_params), self.reducer.pool,
                                 fused=self.reducer.config.comm_fusion,
                                 host=self.reducer.config.host_copies,
                                 buffers=[self._buffer(i) for i in range(len(self.params))])

    def prefetch(self) -> None:
        """Launch this unit's all-gathers now (another unit's forward started), unless they are
        launched or done already; its own forward then waits on them."""
        if self._gathered or self._prefetched is not None or not self.params:
            return
        self._prefetched = self._launch_gather([p.sharded_param for p in self.params])

    def prefetch_for_backward(self) -> None:
        """Launch the all-gathers this unit's backward will need (another unit's backward
        started), unless its parameters are still gathered or the gather is launched already."""
        if self._prefetched is None and self.needs_gather():
            self._prefetched = self._launch_gather([p.sharded_param for p in self.params])

    def abandon_prefetch(self) -> None:
        if self._prefetched is not None:
            pending, self._prefetched = self._prefetched, None
            pending.abandon()

    # -- backward ---------------------------------------------------------------------------------
    def _pre_backward(self, cell, grad_output):
        """Before the unit's ops' backward: its parameters gathered again (released after
        forward) and installed (a recompute forward reads them), then the next unit's gather
        launched (once per backward for a list unit)."""
        self.runtime.backward_started(self)
        if self.needs_gather():
            self.gather([p.sharded_param for p in self.params])
        self._install_for_backward()
        if self._in_backward:
            return None
        self._in_backward = True
        for unit in self._backward_prefetch_targets():
            unit.prefetch_for_backward()
        return None

    def _backward_prefetch_targets(self) -> list:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        following = self.runtime.next_in_backward(self)
        return [] if following is None else [following]

    def on_backward(self, grads) -> tuple:
        for buffer in self._buffers:
            if buffer is not None and not buffer.valid:
                # autograd has just read this memory: it was released and never gathered again
                raise LeaseStateError(
                    f"fully_shard unit {[type(m).__name__ for m in self.modules]}: its backward "
                    f"read a gathered parameter {buffer.shape} released after forward and not "
                    "gathered again (its backward pre-hook did not run)")
        self.runtime.backward_started(self)
        self._in_backward = False
        self.uses_awaiting_backward = max(0, self.uses_awaiting_backward - 1)
        grads = [g if g is not None else mint.zeros(p.orig_shape, dtype=p.param_dtype or p.orig_dtype)
                 for p, g in zip(self.params, grads)]
        self.finish_async_reduce()       # this unit's reduce of an earlier backward lands first
        for param, grad in zip(self.params, grads):
            param.take_gradient(grad)
        if not self.requires_sync:
            self._accumulate(self.params)
            self._end_of_backward()
            return self._zero_grads()
        self.reduce(self.params, self._wire_op())
        if self._holds_partials():
            out = self._keep_partials()
        elif self.async_reduce:
            out = self._leave_in_flight()
        elif self.mp_policy.apply_grad_on_fp32_main_grad:
            self._land_in_main_grad()
            out = self._zero_grads()
        else:
            out = self._owned_shard_grads()
        self._end_of_backward()
        return out

    def _owned_shard_grads(self) -> tuple:
        """The reduced shards as tensors autograd owns (pool memory never leaves the pool: a
        view of an output bucket handed to autograd would be recycled by this unit's next
        backward, e.g. a second use in the same forward, before autograd sums the uses); the
        output buckets go back to the pool at once."""
        try:
            shards = [p.reduce_scatter_output() for p in self.params]   # fused: read all first
            return tuple(p.apply_reduced_grad(self._scaled(shard))
                         for p, shard in zip(self.params, shards))
        finally:
            for param in self.params:
                param.clear_reduce_scatter_output()

    def _zero_grads(self) -> tuple:
        return tuple(self.runtime.shared_zeros(p.local_shape, p.orig_dtype) for p in self.params)

    # -- asynchronous reduce (main_grad mode) -----------------------------------------------------
    def _leave_in_flight(self) -> tuple:
        """The reduce just launched stays in flight; autograd gets zeros."""
        for param in self.params:
            param.launched()
        self.async_stats.launched += 1
        if any(p.reduce_in_flight() for p in self.params):
            self.async_stats.returned_in_flight += 1
        self.runtime.in_flight.append(self)
        return self._zero_grads()

    def finish_async_reduce(self) -> None:
        """Wait for this unit's reduce still in flight (if any) and add it into ``main_grad``."""
        if self not in self.runtime.in_flight:
            return
        self.runtime.in_flight.remove(self)   # taken off first: whatever happens, applied once
        self._land_in_main_grad()
        self.async_stats.finished += 1

    def _land_in_main_grad(self) -> None:
        """Add this unit's reduced shards into ``main_grad`` and give their output buckets back
        at once (nothing else reads them: autograd gets zeros in main_grad mode)."""
        try:
            # every result waited before any main_grad changes (fused results are shared)
            shards = [p.reduce_scatter_output() for p in self.params]
            for param, shard in zip(self.params, shards):
                param.add_to_main_grad(self._scaled(shard))
        finally:
            for param in self.params:
                param.clear_reduce_scatter_output()
                param.drop_gradient()

    # -- HSDP without the replicate all-reduce (set_requires_all_reduce(False)) -------------------
    def _holds_partials(self) -> bool:
        return self.reducer.replicate_comm is not None and not self.requires_all_reduce

    def _keep_partials(self) -> tuple:
        """This backward was reduce-scattered in the shard group only: each shard is a replica's
        partial sum, kept (float32, outside the pool) until a backward with the all-reduce adds
        it in. Nothing reaches ``main_grad`` yet, and autograd gets zeros."""
        for param in self.params:            # results are shared: read every shard first
            shard = param.reduce_scatter_output().astype(ms.float32)
            param.partial = shard if param.partial is None else mint.add(param.partial, shard)
        for param in self.params:
            param.clear_reduce_scatter_output()
        return self._zero_grads()

    def _add_partials_and_all_reduce(self, op: str) -> None:
        """The backward with the all-reduce after ones without: reduce-scatter this backward in
        the shard group, add the kept partials, then all-reduce the sums across the replicas
        (in pool buckets), so every micro-step's gradient is averaged over the whole mesh."""
        sharded, replicated = self._split(self.params)
        totals = []
        for group, result in ((sharded, self._reduce_group(sharded, op, across=False, all=False)),
                              (replicated, self._reduce_group(replicated, op, across=False,
                                                              all=True))):
            if result is None:
                continue
            for index, param in enumerate(group):
                shard = result.wait()[index]
                if tuple(shard.shape) != param.local_shape:
                    shard = shard.reshape(param.local_shape)
                total = shard.astype(ms.float32)
                if param.partial is not None:
                    total = mint.add(total, param.partial)
                totals.append((param, total))
            result.release()
        for param in self.params:
            param.finish_reduce_input()
        params = [p for p, _ in totals]
        flat = [t.reshape(1) if t.ndim == 0 else t for _, t in totals]
        _adopt(params, self.reducer.all_reduce_replicas(flat, op=op))
        for param in params:
            param.partial = None

    def _reduce_group(self, group, op: str, across: bool, all: bool):
        if not group:
            return None
        grads = [p.unsharded_grad for p in group]
        if all:
            return self.reducer.all_reduce(grads, op=op, across_replicas=across)
        return self.reducer.reduce_scatter(grads, [p.shard_dim for p in group], op=op,
                                           across_replicas=across)

    def _wire_op(self) -> str:
        """The reducer's op: a divide factor replaces the op's own division by a plain sum."""
        return "sum" if self.gradient_divide_factor is not None else self.reduce_op

    def _scaled(self, reduced: ms.Tensor) -> ms.Tensor:
        if self.gradient_divide_factor is not None:
            reduced = mint.div(reduced, self.gradient_divide_factor)   # out of place
        if self.gradient_scaling_factor == 1.0:
            return reduced
        return mint.mul(reduced, self.gradient_scaling_factor)     # out of place: a new tensor

    def _end_of_backward(self) -> None:
        """After one use's backward: the gathered memory goes once no recorded use of this unit
        awaits its backward (another use's ops may still read it); the end of the backward pass
        settles every unit either way (:meth:`settle_backward`)."""
        if self.uses_awaiting_backward == 0:
            self._outside_uses = 0
            self._release_after_backward()
        if self.is_root and not in_backward():
            # called outside autograd (no final callback to queue): the root ends the step
            self.runtime.end_backward_pass()

    def _release_after_backward(self) -> None:
        if self.reshard_after_backward or self._installed_for_backward:
            self.uninstall()            # what unshard() or the backward pre-hook installed
        self._installed_for_backward = False
        if self.reshard_after_backward:
            self.release_gathered()

    def settle_backward(self) -> None:
        """The backward pass ended (autograd's final callback): uses that got no backward (an
        output the loss ignored) no longer hold the unit's gathered memory."""
        self._in_backward = False
        self.uses_awaiting_backward = 0
        self._outside_uses = 0
        if not self._gathered:
            self._release_after_backward()

    def reduce(self, params: list[MindSporeHSDPParamV2], op: str) -> None:
        """The unit's one reduce path: hand the gradients of ``params`` (and, for the whole unit,
        the micro-steps accumulated so far) to the reducer once per group (sharded, replicated),
        and let each parameter adopt its entry of the result. Fused or not is the reducer's
        grouping. ``op`` was checked where it came in (``set_reduce_op``, ``reduce_scatter_grad``)."""
        self._agree(REDUCE)
        for param in params:
            param.clear_reduce_scatter_output()
        if self.requires_all_reduce and any(p.partial is not None for p in params) \
                and self._pending is None:
            self._add_partials_and_all_reduce(op)
            return
        sharded, replicated = self._split(params)
        if self._pending is not None and params == self.params:
            self._accumulate(params)
            (sharded_buckets, replicated_buckets), self._pending = self._pending, None
            try:
                if sharded:
                    _adopt(sharded, self.reducer.launch(sharded_buckets, op=op,
                                                        count=len(sharded),
                                                        across_replicas=self.requires_all_reduce))
            except BaseException:
                self.reducer.discard(replicated_buckets)   # the failed launch gave back its own
                raise
            if replicated:
                _adopt(replicated, self.reducer.launch(
                    replicated_buckets, op=op, count=len(replicated), all_reduce=True,
                    across_replicas=self.requires_all_reduce))
            return
        if sharded:
            _adopt(sharded, self.reducer.reduce_scatter(
                [p.unsharded_grad for p in sharded], [p.shard_dim for p in sharded], op=op,
                across_replicas=self.requires_all_reduce))
        if replicated:
            _adopt(replicated, self.reducer.all_reduce([p.unsharded_grad for p in replicated],
                                                       op=op,
                                                       across_replicas=self.requires_all_reduce))

    @staticmethod
    def _split(params):
        return [p for p in params if not p.replicate], [p for p in params if p.replicate]

    def _pack_for_accumulation(self, params) -> tuple[list, list]:
        """Pack the sharded and the replicated gradients into buckets of their own (never
        borrowed: later micro-steps add into them); on failure give back what was packed."""
        sharded, replicated = self._split(params)
        packed: tuple[list, list] = ([], [])
        try:
            if sharded:
                packed[0].extend(self.reducer.pack(
                    [p.unsharded_grad for p in sharded], [p.shard_dim for p in sharded],
                    allow_borrow=False))
            if replicated:
                packed[1].extend(self.reducer.pack([p.unsharded_grad for p in replicated],
                                                   world_size=1, allow_borrow=False))
        except BaseException:
            self._discard(packed)
            raise
        return packed

    def _discard(self, packed) -> None:
        for buckets in packed:
            self.reducer.discard(buckets)

    def _accumulate(self, params) -> None:
        """A micro-step: pack (first) or add (later) the gradients into the unit's buckets."""
        if self._pending is None:
            self._pending = self._pack_for_accumulation(params)
        else:
            sharded, replicated = self._split(params)
            try:
                self.reducer.accumulate(self._pending[0], [p.unsharded_grad for p in sharded])
                self.reducer.accumulate(self._pending[1], [p.unsharded_grad for p in replicated])
            except BaseException:
                self._discard(self._pending)
                self._pending = None
                raise
        for param in params:
            param.finish_local_use()

    # -- controls ---------------------------------------------------------------------------------
    def set_reduce_op(self, op: str) -> None:
        check_reduce_op(op)
        self.reduce_op = op
        self.gradient_divide_factor = None

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Checked by ``HSDPModule.set_gradient_divide_factor``."""
        self.gradient_divide_factor = factor

    def zero_grad(self) -> None:
        """Drop this unit's gradients; reduces still in flight (any unit's, in launch order) are
        waited first, so none lands after the zeroing or is lost in flight. A grad graph an
        exception left open is closed here, between steps."""
        self.runtime.close_abandoned_grad_graph()
        try:
            self.runtime.finish_async_reduces()
        finally:
            self._zero_grad()

    def _zero_grad(self) -> None:
        if self._pending is not None:
            for buckets in self._pending:
                self.reducer.discard(buckets)
            self._pending = None
        for param in self.params:
            param.zero_grad()
            param.partial = None


def _adopt(params, result) -> None:
    for index, param in enumerate(params):
        param.attach_result(result, index)


def _cast_floating(value, dtype):
    if isinstance(value, ms.Tensor) and value.dtype in SUPPORTED_DTYPES \
            and value.dtype != dtype:
        return value.astype(dtype)
    return value
