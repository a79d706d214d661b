"""The reduce path of one ``fully_shard`` unit: what its backward does with the full gradients.

* synchronized backward: one reduce per group (sharded parameters reduce-scattered, replicated
  ones all-reduced; fused or not is the reducer's grouping), then the result goes to autograd as
  owned shard gradients, into ``main_grad`` now, or (asynchronous, main_grad mode) stays in
  flight until the runtime lands it: when the unit after the next one launches its reduce, or
  at the end of backward;
* micro-steps (``set_requires_gradient_sync(False)``): packed into the unit's own buckets, later
  ones added in; the next synchronized backward reduces the buckets once;
* HSDP without the replicate all-reduce (``set_requires_all_reduce(False)``): each replica's
  partial sums kept outside the pool until a backward with the all-reduce adds them in.

Pool memory never leaves the pool: autograd gets owned copies or shared zeros.
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import mindspore as ms
from mindspore import mint

from gradpool import GradReducer, PackedBucket
from hyper_parallel.platform.mindspore.fully_shard.order import REDUCE
from hyper_parallel.platform.mindspore.fully_shard.param import (MindSporeHSDPParamV2,
                                                                  owned_copy)
from hyper_parallel.platform.mindspore.fully_shard.settings import UnitSettings


@dataclass
class AsyncReduceStats:
    """Counters of one unit's asynchronous reduces."""

    launched: int = 0            # backwards that left their reduce in flight
    returned_in_flight: int = 0  # ... whose collective had not completed when the backward returned
    finished: int = 0            # reduces waited and added into main_grad


@contextmanager
def reduced_shards(params):
    """Every parameter's reduced shard, all read before any is used (fused results share one
    output bucket); the output buckets go back to the pool when the block ends, whatever
    happens."""
    try:
        yield [p.reduced_shard() for p in params]
    finally:
        for param in params:
            param.clear_reduce_scatter_output()


def _adopt(params, result) -> None:
    for index, param in enumerate(params):
        param.attach_result(result, index)


class UnitReduce:
    """Reduces, accumulates and lands the gradients of one unit's parameters."""

    def __init__(self, params: list[MindSporeHSDPParamV2], reducer: GradReducer, mp_policy,
                 settings: UnitSettings, runtime, async_reduce: bool,
                 order_tag: Callable[..., object], owner):
        """``async_reduce``: leave each backward's reduce in flight (main_grad mode only).
        ``order_tag(kind, agree=True)``: the unit-order tag the reduce carries, or None (strict
        mode agrees inside that call when ``agree``; :mod:`.order`).
        ``owner``: the unit, as the runtime's in-flight list holds it (it lands the reduce
        through ``owner.finish_async_reduce()``); held weakly, as the runtime does: the unit
        owns this path."""
        self.params = params
        self.reducer = reducer
        self.mp_policy = mp_policy
        self.settings = settings
        self.runtime = runtime
        self.async_reduce = async_reduce
        self.async_stats = AsyncReduceStats()
        self._order_tag = order_tag
        self._owner = weakref.ref(owner)
        self._pending: tuple[list[PackedBucket], list[PackedBucket]] | None = None

    # -- one backward ------------------------------------------------------------------------------
    def backward(self, grads) -> tuple:
        """Take one use's full gradients; what autograd gets back for the local shards."""
        self.finish_async_reduce()       # this unit's reduce of an earlier backward lands first
        for param, grad in zip(self.params, grads):
            param.take_gradient(grad)
        if not self.settings.requires_sync:
            self._accumulate(self.params)
            return self._zero_grads()
        if self.async_reduce and not self._holds_partials():
            # the reduce about to launch stays in flight: older ones land first (their output
            # buckets back in the pool before this one's is taken), the previous unit's stays
            self.runtime.land_before_previous()
        self.reduce(self.params, self._wire_op())
        if self._holds_partials():
            return self._keep_partials()
        if self.async_reduce:
            return self._leave_in_flight()
        if self.mp_policy.apply_grad_on_fp32_main_grad:
            self._land_in_main_grad()
            return self._zero_grads()
        return self._owned_shard_grads()

    def _owned_shard_grads(self) -> tuple:
        """The reduced shards as tensors autograd owns (pool memory never leaves the pool: a
        view of an output bucket handed to autograd would be recycled by this unit's next
        backward, e.g. a second use in the same forward, before autograd sums the uses); the
        output buckets go back to the pool at once."""
        with reduced_shards(self.params) as shards:
            return tuple(p.apply_reduced_grad(self._scaled(shard))
                         for p, shard in zip(self.params, shards))

    def _zero_grads(self) -> tuple:
        return tuple(self.runtime.shared_zeros(p.local_shape, p.orig_dtype) for p in self.params)

    # -- asynchronous reduce (main_grad mode) ------------------------------------------------------
    def _leave_in_flight(self) -> tuple:
        """The reduce just launched stays in flight; autograd gets zeros."""
        for param in self.params:
            param.launched()
        self.async_stats.launched += 1
        if any(p.reduce_in_flight() for p in self.params):
            self.async_stats.returned_in_flight += 1
        self.runtime.left_in_flight(self._owner())
        return self._zero_grads()

    def finish_async_reduce(self) -> None:
        """Wait for this unit's reduce still in flight (if any) and add it into ``main_grad``."""
        # taken off first: whatever happens, applied once
        if not self.runtime.take_in_flight(self._owner()):
            return
        self._land_in_main_grad()
        self.async_stats.finished += 1

    def _land_in_main_grad(self) -> None:
        """Add this unit's reduced shards into ``main_grad`` and give their output buckets back
        at once (nothing else reads them: autograd gets zeros in main_grad mode). The first
        landing since ``zero_grad`` allocates each ``main_grad`` (a copy out of the bucket, or
        the scaled shard, a tensor of its own already)."""
        try:
            # every result waited before any main_grad changes (fused results are shared)
            with reduced_shards(self.params) as shards:
                for param, shard in zip(self.params, shards):
                    scaled = self._scaled(shard)
                    param.add_to_main_grad(scaled, owned=scaled is not shard)
        finally:
            for param in self.params:
                param.drop_gradient()

    # -- HSDP without the replicate all-reduce (set_requires_all_reduce(False)) -------------------
    def _holds_partials(self) -> bool:
        return self.reducer.replicate_comm is not None and not self.settings.requires_all_reduce

    @property
    def keeps_partials(self) -> bool:
        """HSDP with ``set_requires_all_reduce(False)``: the backward keeps partial sums."""
        return self._holds_partials()

    def _keep_partials(self) -> tuple:
        """This backward was reduce-scattered in the shard group only: each shard is a replica's
        partial sum, kept (float32, outside the pool) until a backward with the all-reduce adds
        it in. Nothing reaches ``main_grad`` yet, and autograd gets zeros."""
        with reduced_shards(self.params) as shards:
            for param, shard in zip(self.params, shards):
                shard = owned_copy(shard, ms.float32)      # kept past the bucket's return
                param.partial = shard if param.partial is None else mint.add(param.partial, shard)
        return self._zero_grads()

    def _add_partials_and_all_reduce(self, op: str, tag) -> None:
        """The backward with the all-reduce after ones without: reduce-scatter this backward in
        the shard group, add the kept partials, then all-reduce the sums across the replicas
        (in pool buckets), so every micro-step's gradient is averaged over the whole mesh. Both
        collectives carry ``tag``."""
        totals = []
        for position, (group, replicated) in enumerate(self._groups(self.params)):
            result = self._reduce_group(group, replicated, op, across=False,
                                        tag=tag if position == 0 else None)
            for index, param in enumerate(group):
                shard = result.wait()[index]
                if tuple(shard.shape) != param.local_shape:
                    shard = shard.reshape(param.local_shape)
                total = owned_copy(shard, ms.float32)      # all-reduced after the release
                if param.partial is not None:
                    total = mint.add(total, param.partial)
                totals.append((param, total))
            result.release()
        for param in self.params:
            param.finish_reduce_input()
        params = [p for p, _ in totals]
        flat = [t.reshape(1) if t.ndim == 0 else t for _, t in totals]
        _adopt(params, self.reducer.all_reduce_replicas(flat, op=op, tag=tag))
        for param in params:
            param.partial = None

    # -- the one reduce path ------------------------------------------------------------------------
    @staticmethod
    def _split(params) -> tuple[list, list]:
        """The sharded and the replicated parameters: the two reduce differently
        (reduce-scatter / all-reduce), and index ``replicated`` into ``(sharded, replicated)``
        pairs such as the micro-step buckets."""
        return [p for p in params if not p.replicate], [p for p in params if p.replicate]

    def _groups(self, params) -> list:
        """``(group, replicated)`` for the non-empty groups of :meth:`_split`, sharded first."""
        return [(group, bool(index)) for index, group in enumerate(self._split(params)) if group]

    def _reduce_group(self, group, replicated: bool, op: str, across: bool, tag=None):
        grads = [p.unsharded_grad for p in group]
        if replicated:
            return self.reducer.all_reduce(grads, op=op, across_replicas=across, tag=tag)
        return self.reducer.reduce_scatter(grads, [p.shard_dim for p in group], op=op,
                                           across_replicas=across, tag=tag)

    def _tag(self, agree: bool = True):
        """The unit-order tag of this unit's reduce, when the reduce is a collective."""
        if self.reducer.comm.world_size == 1 and self.reducer.replicate_comm is None:
            return None
        return self._order_tag(REDUCE, agree)

    def _wire_op(self) -> str:
        """The reducer's op: a divide factor replaces the op's own division by a plain sum."""
        return "sum" if self.settings.gradient_divide_factor is not None \
            else self.settings.reduce_op

    def _scaled(self, reduced: ms.Tensor) -> ms.Tensor:
        if self.settings.gradient_divide_factor is not None:
            reduced = mint.div(reduced, self.settings.gradient_divide_factor)   # out of place
        if self.settings.gradient_scaling_factor == 1.0:
            return reduced
        return mint.mul(reduced, self.settings.gradient_scaling_factor)  # out of place: new tensor

    def reduce(self, params: list[MindSporeHSDPParamV2], op: str) -> None:
        """Hand the gradients of ``params`` (and, for the whole unit, the micro-steps accumulated
        so far) to the reducer once per group (sharded, replicated), and let each parameter adopt
        its entry of the result. Fused or not is the reducer's grouping. ``op`` was checked where
        it came in (``set_reduce_op``, ``reduce_scatter_grad``)."""
        tag = self._tag()
        for param in params:
            param.clear_reduce_scatter_output()
        across = self.settings.requires_all_reduce
        if across and any(p.partial is not None for p in params) and self._pending is None:
            self._add_partials_and_all_reduce(op, tag)
            return
        if self._pending is not None and params == self.params:
            self._launch_accumulated(params, op, across)     # its buckets carry the tag
            return
        for position, (group, replicated) in enumerate(self._groups(params)):
            _adopt(group, self._reduce_group(group, replicated, op, across,
                                             tag=tag if position == 0 else None))

    def _launch_accumulated(self, params, op: str, across: bool) -> None:
        """The last micro-step: add its gradients into the unit's buckets and reduce them."""
        self._accumulate(params)
        pending, self._pending = self._pending, None
        groups = self._groups(params)
        for position, (group, replicated) in enumerate(groups):
            try:
                result = self.reducer.launch(pending[replicated], op=op, count=len(group),
                                             all_reduce=replicated, across_replicas=across)
            except BaseException:
                # the failed launch gave back its own buckets; those not launched go back here
                for _, later in groups[position + 1:]:
                    self.reducer.discard(pending[later])
                raise
            _adopt(group, result)

    # -- micro-steps --------------------------------------------------------------------------------
    def _pack_for_accumulation(self, params) -> tuple[list, list]:
        """Pack the sharded and the replicated gradients into buckets of their own (never
        borrowed: later micro-steps add into them); on failure give back what was packed."""
        packed: tuple[list, list] = ([], [])
        tag = self._tag(agree=False)     # filled when the last micro-step launches the buckets
        try:
            for position, (group, replicated) in enumerate(self._groups(params)):
                grads = [p.unsharded_grad for p in group]
                group_tag = tag if position == 0 else None
                if replicated:
                    packed[1].extend(self.reducer.pack(grads, world_size=1, allow_borrow=False,
                                                       tag=group_tag))
                else:
                    packed[0].extend(self.reducer.pack(grads, [p.shard_dim for p in group],
                                                       allow_borrow=False, tag=group_tag))
        except BaseException:
            self.discard(packed)
            raise
        return packed

    def discard(self, packed) -> None:
        for buckets in packed:
            self.reducer.discard(buckets)

    def _accumulate(self, params) -> None:
        """A micro-step: pack (first) or add (later) the gradients into the unit's buckets."""
        if self._pending is None:
            self._pending = self._pack_for_accumulation(params)
        else:
            try:
                for buckets, group in zip(self._pending, self._split(params)):
                    self.reducer.accumulate(buckets, [p.unsharded_grad for p in group])
            except BaseException:
                self.discard(self._pending)
                self._pending = None
                raise
        for param in params:
            param.finish_local_use()

    def drop_everything(self) -> None:
        """The unit was freed: every bucket it holds goes back to the pool (micro-step buckets,
        results in flight or not yet read, whose output buckets go back fenced on their
        collective) and its parameters forget their gradients (a parameter outlives its unit
        until the collector runs)."""
        try:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                self.discard(pending)
        finally:
            for param in self.params:
                param.clear_reduce_scatter_output()
                param.drop_gradient()
                param.partial = None

    def zero_grad(self) -> None:
        """Drop the accumulated buckets, the kept partials and every parameter's gradients."""
        if self._pending is not None:
            self.discard(self._pending)
            self._pending = None
        for param in self.params:
            param.zero_grad()
            param.partial = None
