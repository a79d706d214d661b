"""The pool replay: the acquire/release sequence ``gradpool train`` makes in a training step, run
against a bookkeeping-only model of :class:`gradpool.pool.BucketPool`'s policy (smallest free
bucket that fits, else a new one rounded up to the alignment; a released bucket is reusable once
its fence has completed; at ``max_buckets_in_flight`` fenced buckets of a dtype ``acquire``
first waits for the oldest). See :mod:`gradpool.app.plan` for why a replay and not a formula.

Fences: on CPU every collective has completed when it returns (MindSpore's CPU collectives are
synchronous), so a released input bucket is free at once. On Ascend a fence counts as in flight
until the unit's backward waits on it (MindSpore's ``CommHandle`` has no ``is_completed()``), so
up to ``max_buckets_in_flight`` input buckets are held at once; HSDP waits for each
reduce-scatter before its replicate all-reduce, which completes the fence right away.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gradpool.app.config import RunConfig
from gradpool.app.model import ParamSpec
from gradpool.app.plan.geometry import _dtype, _Geometry, _groups, _Reduce, _Unit
from gradpool.app.plan.options import ITEMSIZE, MIB
from gradpool.layout import ReduceScatterLayout, round_up
from gradpool.reuse import FREE, FreeIndex


# -- the pool replay ---------------------------------------------------------------------------
@dataclass(eq=False)
class _Bucket:
    index: int                   # allocation order (the pool breaks capacity ties by it)
    dtype: str
    capacity: int                # elements
    state: str = FREE            # free | leased | fenced
    handle: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return self.capacity * ITEMSIZE[self.dtype]


class _PoolReplay:
    """BucketPool's bookkeeping without memory: the same bucket for every acquire.

    The bucket reused is the pool's own rule (:mod:`gradpool.reuse`), in its indexed form so that
    a 671B plan (tens of thousands of buckets) replays in seconds; fenced buckets are kept in
    release order per dtype. A fence is recycled as soon as its handle completes; the pool does
    it lazily (at its next acquire or stats), which chooses the same buckets, since nothing in
    between looks at them."""

    def __init__(self, alignment_bytes: int, max_in_flight: Optional[int]):
        self.alignment_bytes = alignment_bytes
        self.max_in_flight = max_in_flight
        self.buckets: list[_Bucket] = []
        self.reserved = 0
        self.high_water = 0
        self.new_allocations = 0
        self.stalls = 0
        self.fenced_bytes = 0
        self._free = FreeIndex()
        self._fenced: dict = {}          # dtype -> {bucket index: None}, oldest first
        self._on_handle: dict = {}       # handle -> [bucket], fenced on it
        self._done: set[int] = set()
        self._handles = 0

    def align(self, dtype: str) -> int:
        return max(1, self.alignment_bytes // ITEMSIZE[dtype])

    def handle(self, completed: bool) -> int:
        self._handles += 1
        if completed:
            self._done.add(self._handles)
        return self._handles

    def complete(self, handle: int) -> None:
        self._done.add(handle)
        for bucket in self._on_handle.pop(handle, ()):
            self._recycle(bucket)

    def acquire(self, numel: int, dtype: str) -> _Bucket:
        fenced = self._fenced.setdefault(dtype, {})
        while self.max_in_flight is not None and len(fenced) >= self.max_in_flight:
            oldest = self.buckets[next(iter(fenced))]
            self.stalls += 1                     # the pool waits on the oldest fence
            self.complete(oldest.handle)
        bucket = self._free.take(numel, dtype)
        if bucket is None:
            bucket = _Bucket(len(self.buckets), dtype, round_up(numel, self.align(dtype)))
            self.buckets.append(bucket)
            self.reserved += bucket.nbytes
            self.new_allocations += 1
            self.high_water = max(self.high_water, self.reserved)
        bucket.state = "leased"
        return bucket

    def release(self, bucket: _Bucket, handle: Optional[int] = None) -> None:
        if handle is None or handle in self._done:
            self._recycle(bucket)
            return
        bucket.state, bucket.handle = "fenced", handle
        self._fenced.setdefault(bucket.dtype, {})[bucket.index] = None
        self._on_handle.setdefault(handle, []).append(bucket)
        self.fenced_bytes += bucket.nbytes

    def wait_all(self) -> None:
        for handle in list(self._on_handle):
            self.complete(handle)

    def _recycle(self, bucket: _Bucket) -> None:
        if bucket.state == "fenced":
            del self._fenced[bucket.dtype][bucket.index]
            self.fenced_bytes -= bucket.nbytes
        if bucket.state != FREE:
            self._free.add(bucket, bucket.index)
        bucket.state, bucket.handle = FREE, None


# -- one training step, as gradpool train makes it ---------------------------------------------
@dataclass
class _StepCounts:
    bytes_copied: int = 0        # written into buckets (padding included): the pool's stat
    bytes_read: int = 0          # read from autograd's gradients (for the time estimate)
    padding_bytes: int = 0
    input_peak: int = 0          # most bytes held by input buckets (leased or fenced) at once
    output_bytes: int = 0        # output buckets held at the end of backward


class _StepReplay:
    def __init__(self, cfg: RunConfig, geo: _Geometry, pool: _PoolReplay):
        self.cfg, self.geo, self.pool = cfg, geo, pool
        self.device_fences = cfg.launch.device == "Ascend"
        micro = cfg.train.micro_steps
        every = cfg.fully_shard.all_reduce_every_micro_step
        # a unit's output buckets go back in its own backward (synchronous: added into main_grad,
        # or copied into tensors autograd owns) or, asynchronous (main_grad mode only), when the
        # unit after the next one launches its reduce, the last two at the end of backward
        self.main_grad = cfg.fully_shard.apply_grad_on_fp32_main_grad
        self.async_reduce = self.main_grad and cfg.gradpool.async_reduce
        # set_requires_gradient_sync(last): micro-steps packed into the units' buckets, one reduce
        self.accumulate = micro > 1 and every
        # HSDP set_requires_all_reduce(last): reduce-scatter each micro-step, all-reduce the sums
        # (units with replicas only: experts are 1-D over their EDP ranks)
        self.partials = micro > 1 and geo.replicas > 1 and not every
        self.outputs: list = []          # held until the next zero_grad (HSDP partial sums)
        self._drained: list = []         # per unit in flight, launch order: its output buckets
        self.counts = _StepCounts()
        self._input_bytes = 0

    def run(self) -> _StepCounts:
        self.counts = _StepCounts()
        for bucket in self.outputs:          # model.zero_grad(): every unit's outputs go back
            self.pool.release(bucket)
        self.outputs = []
        micro = self.cfg.train.micro_steps
        accumulate = self.accumulate
        pending: dict = {}
        for index in range(micro):
            last = index == micro - 1
            self._forward()
            # the layers, last one first (a layer's experts before its dense part), then the root
            for unit in [*reversed(self.geo.units[1:]), self.geo.units[0]]:
                partials = self.partials and unit.replicas > 1
                self._backward(unit, index, last, accumulate, partials, pending)
            self.pool.wait_all()             # the root's backward ends the step
            self._land(keep=0)               # the rest lands in main_grad
        self.counts.output_bytes = sum(b.nbytes for b in self.outputs)
        return self.counts

    def _forward(self) -> None:
        for unit in self.geo.units:          # the root's gather runs first, then each layer's
            if unit.gather is None:
                continue
            send = self.pool.acquire(unit.gather[0], "float32")
            recv = self.pool.acquire(unit.gather[1], "float32")
            self.pool.release(send)
            self.pool.release(recv)

    def _backward(self, unit: _Unit, index: int, last: bool, accumulate: bool, partials: bool,
                  pending: dict) -> None:
        reduce = self.geo.reduce_dtype
        if accumulate and not last:
            if index == 0:                   # pack once, then add into the same buckets
                pending[unit.name] = [self._input(r) for r in unit.reduces]
            else:
                for r in unit.reduces:
                    self._copy(r.layout, reduce, padding=False)
            return
        if self.async_reduce and not partials:
            self._land(keep=1)               # older reduces land before this one launches
        handles = []
        if accumulate:                       # the last micro-step adds, then launches
            inputs = pending.pop(unit.name)
            for r in unit.reduces:
                self._copy(r.layout, reduce, padding=False)
        else:
            inputs = None
        outs = []
        for position, r in enumerate(unit.reduces):
            bucket = inputs[position] if inputs is not None else self._input(r)
            out = self.pool.acquire(r.layout.row_numel, reduce)
            handle = self.pool.handle(completed=not self.device_fences)
            self.pool.release(bucket, handle)
            self._input_bytes -= bucket.nbytes
            if unit.replicas > 1 and not partials:
                self.pool.complete(handle)   # waited before the replicate all-reduce
            handles.append(handle)
            outs.append(out)
        for handle in handles:               # the unit's backward reads its shards
            self.pool.complete(handle)
        if partials:
            for out in outs:                 # read into the kept partial sums, then released
                self.pool.release(out)
            if last:
                self._all_reduce_partials(unit)
            return
        if not self.async_reduce:
            for out in outs:                 # added into main_grad, or copied for autograd, at once
                self.pool.release(out)
            return
        self._drained.append(outs)

    def _land(self, keep: int) -> None:
        """Asynchronous reduces land in main_grad, in launch order, but the ``keep`` last."""
        while len(self._drained) > keep:
            for bucket in self._drained.pop(0):
                self.pool.release(bucket)

    def _all_reduce_partials(self, unit: _Unit) -> None:
        """HSDP without the replicate all-reduce on earlier micro-steps: the float32 totals of
        the local shards are packed and all-reduced across replicas in pool buckets, which are
        the outputs until the next step."""
        dtype = _dtype(self.cfg.fully_shard.reduce_dtype, "float32")
        local = [slot.chunk_shape for r in unit.reduces for slot in r.layout.slots]
        specs = [ParamSpec(str(i), shape, unit.name) for i, shape in enumerate(local)]
        for group in _groups(specs, ITEMSIZE[dtype], self.cfg.gradpool.bucket_cap_mib * MIB,
                             self.cfg.fully_shard.comm_fusion):
            layout = ReduceScatterLayout.build([s.shape for s in group], 1, self.pool.align(dtype))
            bucket = self.pool.acquire(layout.total_numel, dtype)
            self._copy(layout, dtype, padding=True, source="float32")
            self.outputs.append(bucket)

    def _input(self, r: _Reduce) -> _Bucket:
        bucket = self.pool.acquire(r.layout.total_numel, self.geo.reduce_dtype)
        self._input_bytes += bucket.nbytes
        self._copy(r.layout, self.geo.reduce_dtype, padding=True)
        # inputs still leased (packed, not launched) plus inputs fenced on their collective
        self.counts.input_peak = max(self.counts.input_peak,
                                     self._input_bytes + self.pool.fenced_bytes)
        return bucket

    def _copy(self, layout: ReduceScatterLayout, dtype: str, padding: bool,
              source: Optional[str] = None) -> None:
        size = ITEMSIZE[dtype]
        self.counts.bytes_copied += layout.total_numel * size
        self.counts.bytes_read += layout.data_numel * ITEMSIZE[source or self.geo.compute_dtype]
        if padding:
            self.counts.padding_bytes += layout.padding_numel * size


