"""The reduce path in one place: lease -> pack -> collective -> fence -> shard views -> recycle.

Usage::

    reducer = GradReducer(pool, communicator, ReducerConfig(reduce_dtype=ms.float32))
    result = reducer.reduce_scatter(grads)          # packs into pool buckets, launches
    shards = result.wait()                          # one shard view per gradient, in order
    result.release()                                # once shards are used: buckets back to pool

Lifetimes: the **input** bucket is released right after launch, fenced on the collective's
handle, so the pool leases it again only once the collective has completed. With ``zero_copy``
the collective reads the caller's gradient in place, a *borrow* the result holds until ``wait()``
returns (released earlier, the pool holds it with the fence); it is never freed. The **output**
bucket, which the shard views from ``wait()`` are views of, stays leased until
``result.release()``, the caller's job (hyper_parallel's param module, once the shard gradient
is consumed).

A collective that fails (its handle's ``wait()`` or ``is_completed()`` raises) is raised from
``result.wait()`` as :class:`~gradpool.errors.CollectiveError` naming it, and the pool
quarantines its input and output buckets: a failed collective may still be writing them.

**Row tags** (``tag=``, a :class:`RowTag`): one bucket of a call (its smallest) reserves
``tag.numel`` elements at the end of every row; at launch every row's tail gets
``tag.values(dtype)`` (queued device writes), and the first ``wait()`` hands the reduced tail
(this rank's row of the sums, after the replicate all-reduce for HSDP) to ``tag.check_reduced``,
on the device. ``fully_shard`` carries its unit-order tag this way: no collective of its own.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import mindspore as ms

from gradpool import pack as packing
from gradpool.comm import CommHandle, Communicator, check_reduce_op
from gradpool.device import synchronize
from gradpool.dtypes import check_dtype, itemsize
from gradpool.errors import (CollectiveError, InvalidArgumentError, LayoutMismatchError,
                             LeaseStateError, check_bool, check_positive_number)
from gradpool.layout import ReduceScatterLayout, fusion_groups
from gradpool.pool import BucketPool, Lease, as_fence, fence_done
from gradpool.writers import writer_for

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReducerConfig:
    """How gradients are reduced. ``reduce_dtype=None`` reduces in each gradient's own dtype.
    ``host_copies``: write a CPU pool's buckets through their host memory (the host writer);
    False forces the device writer, the path Ascend takes."""

    reduce_dtype: Any = None
    comm_fusion: bool = False
    bucket_cap_mib: float = 25.0
    zero_copy: bool = False
    host_copies: bool = True

    def __post_init__(self):
        if self.reduce_dtype is not None:
            check_dtype(self.reduce_dtype)
        for name in ("comm_fusion", "zero_copy", "host_copies"):
            check_bool(f"ReducerConfig.{name}", getattr(self, name))
        check_positive_number("ReducerConfig.bucket_cap_mib", self.bucket_cap_mib)


class RowTag(Protocol):
    """Values a caller sends in every row's reserved tail of one bucket, and what it does with
    the reduced tail (see the module's doc)."""

    numel: int

    def values(self, dtype) -> ms.Tensor:
        """The ``numel`` values this rank writes into each row's tail, in ``dtype``."""

    def check_reduced(self, tail: ms.Tensor) -> None:
        """Take this rank's reduced tail (queued device ops only: no host read)."""


@dataclass
class PackedBucket:
    """Gradients ``indices`` packed per ``layout`` into ``lease`` (or borrowed, zero-copy);
    ``tag``: what its rows' reserved tails carry (None: no tail)."""

    indices: list[int]
    layout: ReduceScatterLayout
    dtype: Any
    lease: Optional[Lease] = None
    borrowed: Optional[ms.Tensor] = None
    tag: Optional[RowTag] = None

    @property
    def input_tensor(self) -> ms.Tensor:
        return self.borrowed if self.borrowed is not None else self.lease.tensor


@dataclass
class _Launched:
    bucket: PackedBucket
    output: Lease
    handle: CommHandle


@dataclass
class ReduceResult:
    """In-flight reduction of a list of gradients; ``wait()`` gives one shard view per gradient."""

    count: int
    launched: list[_Launched] = field(default_factory=list)
    _shards: Optional[list] = None
    _released: bool = False
    _error: Optional[BaseException] = None

    def is_completed(self) -> bool:
        return all(item.handle.is_completed() for item in self.launched)

    def wait(self) -> list[ms.Tensor]:
        if self._error is not None:
            # Every parameter of a fused result waits on it: each sees the collective's error.
            raise self._error
        if self._released:
            raise LeaseStateError("this reduce result was released; its shard views are gone")
        if self._shards is None:
            try:
                for item in self.launched:
                    item.handle.wait()
            except Exception as exc:  # noqa: BLE001 - a collective failed: so does every wait
                self._error = exc
                self.release()
                raise
            # (an interrupt while waiting leaves the result as it was: wait() or release() again)
            shards: list = [None] * self.count
            for item in self.launched:
                views = packing.shard_views(item.output.tensor, item.bucket.layout)
                for index, view in zip(item.bucket.indices, views):
                    shards[index] = view
                if item.bucket.tag is not None:
                    item.bucket.tag.check_reduced(
                        packing.row_tail(item.output.tensor, item.bucket.layout))
            for item in self.launched:
                item.bucket.borrowed = None          # the borrow ends with the collective
            self._shards = shards
        return self._shards

    def release(self) -> None:
        """Return the output buckets to the pool; shard views from ``wait()`` become invalid.
        Interrupted part-way, it still gives back every bucket; if some are not back, the result
        stays unreleased and calling it again finishes."""
        if self._released:
            return
        try:
            for item in self.launched:
                _release_output(item)
        except BaseException:
            for item in self.launched:
                try:
                    _release_output(item)
                except Exception:  # noqa: BLE001 - the first error is the one to report
                    logger.exception("releasing an output bucket after an error failed")
            raise
        finally:
            self._released = all(item.output.released for item in self.launched)


def _finished(handle) -> bool:
    """True when ``handle`` completed cleanly; False while pending or failed (a failed one is
    handed to the pool, which quarantines the bucket it fences)."""
    try:
        return fence_done(handle)
    except Exception:  # noqa: BLE001 - the pool sees the same failure and quarantines
        return False


def _release_output(item: _Launched) -> None:
    if item.output.released:
        return
    fence = None if _finished(item.handle) else item.handle
    if fence is not None and item.bucket.borrowed is not None:
        # Released before its collective completed: the borrow must outlive the collective
        # still reading the caller's gradient, so the pool holds it with the fence.
        fence = _BorrowFence(fence, item.bucket.borrowed)
    item.output.release(fence)
    item.bucket.borrowed = None


class _Chain:
    """Two collectives in sequence: waited in order, done when both are; first failure raises."""

    def __init__(self, first, second):
        self._first, self._second = first, second

    def wait(self) -> None:
        self._first.wait()
        self._second.wait()

    def is_completed(self) -> bool:
        return fence_done(self._first) and fence_done(self._second)


class _AllOf:
    """Done when every one of ``handles`` is (a fence for a bucket one of them may read); any
    one failing fails it (the bucket may be the failed collective's input)."""

    def __init__(self, handles: list):
        self._handles = handles

    def wait(self) -> None:
        failure = None
        for handle in self._handles:
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - the rest are waited for first
                failure = failure or exc
        if failure is not None:
            raise failure

    def is_completed(self) -> bool:
        return all(fence_done(handle) for handle in self._handles)


class _Collective:
    """A launched collective's handle with the collective's name. Its first failure (``wait()`` or
    ``is_completed()`` raising) is kept and raised by every later call as
    :class:`CollectiveError`: the pool, which quarantines the buckets it fences, and the result's
    owner, who raises it to the training step, see the same failure whichever looks first (a
    handle may raise only once, or report completed after its wait raised)."""

    __slots__ = ("_handle", "name", "_error")

    def __init__(self, handle, name: str):
        self._handle = as_fence(handle)
        self.name = name
        self._error: Optional[CollectiveError] = None

    def wait(self) -> None:
        if self._error is None:
            try:
                self._handle.wait()
                return
            except Exception as exc:  # noqa: BLE001 - kept, raised typed on every call
                self._fail(exc)
        raise self._error

    def is_completed(self) -> bool:
        if self._error is None:
            try:
                return bool(self._handle.is_completed())
            except Exception as exc:  # noqa: BLE001 - kept, raised typed on every call
                self._fail(exc)
        raise self._error

    def _fail(self, exc: Exception) -> None:
        self._error = exc if isinstance(exc, CollectiveError) else CollectiveError(self.name, exc)
        if self._error is not exc:
            self._error.__cause__ = exc

    def __repr__(self) -> str:
        return f"_Collective({self.name!r}, {self._handle!r})"


def _describe(kind: str, bucket: "PackedBucket", numel: int, comm: Communicator) -> str:
    """The collective's name in errors: what it reduced, in which dtype, over how many ranks."""
    return (f"{kind} of {len(bucket.indices)} gradient(s) {bucket.indices[:8]} "
            f"({numel} x {bucket.dtype}) over {comm.world_size} rank(s) (rank {comm.rank})")


class _BorrowFence:
    """A handle plus the borrowed gradient it reads, alive while the pool keeps this fence."""

    def __init__(self, handle: CommHandle, borrowed: ms.Tensor):
        self._handle = handle
        self._borrowed = borrowed

    def wait(self) -> None:
        self._handle.wait()

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def _check_tensors(grads: Sequence[ms.Tensor]) -> None:
    """Every gradient a MindSpore tensor of a supported dtype (before any bucket is leased)."""
    for index, grad in enumerate(grads):
        packing.check_tensor(index, grad)
        check_dtype(grad.dtype)


class GradReducer:
    """Reduce-scatters (or all-reduces) gradients through pool-owned buckets."""

    def __init__(self, pool: BucketPool, comm: Communicator, config: ReducerConfig = ReducerConfig(),
                 replicate_comm: Optional[Communicator] = None):
        """``comm``: the shard group. ``replicate_comm`` (HSDP): the group of this rank's replicas;
        each reduce-scatter's output is then all-reduced in it, so ``"avg"`` averages over
        every rank of the mesh (``replicate_comm`` None or of one rank: no such step)."""
        self.pool = pool
        self.comm = comm
        self.config = config
        self.writer = writer_for(pool.device, config.host_copies)   # chosen once, for the pool
        self.replicate_comm = replicate_comm \
            if replicate_comm is not None and replicate_comm.world_size > 1 else None
        self.borrows = 0      # gradients the collective read in place (zero-copy)

    # -- planning -------------------------------------------------------------------------------
    def reduce_dtype_for(self, grad: ms.Tensor):
        return self.config.reduce_dtype if self.config.reduce_dtype is not None else grad.dtype

    def _groups(self, grads: Sequence[ms.Tensor]) -> list[tuple[Any, list[int]]]:
        """Gradient indices per bucket: one each, or fused per reduce dtype up to the cap."""
        dtypes = [self.reduce_dtype_for(g) for g in grads]
        return fusion_groups([(d, g.numel() * itemsize(d)) for d, g in zip(dtypes, grads)],
                             self.config.bucket_cap_mib * 2 ** 20, self.config.comm_fusion)

    def _plan(self, grads: Sequence[ms.Tensor], shard_dims: Optional[Sequence[int]],
              world_size: Optional[int], tag: Optional[RowTag] = None
              ) -> list[tuple[Any, list[int], ReduceScatterLayout, Optional[RowTag]]]:
        """``(dtype, gradient indices, layout, tag)`` per bucket, all validated before any lease;
        ``tag`` goes to the smallest bucket (the others keep their layouts, zero-copy too)."""
        _check_tensors(grads)
        world = self.comm.world_size if world_size is None else world_size
        dims = list(shard_dims) if shard_dims is not None else [0] * len(grads)
        if len(dims) != len(grads):
            raise InvalidArgumentError(
                f"shard_dims has {len(dims)} entries for {len(grads)} gradients; give one each")
        def layout(dtype, indices, tail: int = 0) -> ReduceScatterLayout:
            return ReduceScatterLayout.build(
                [tuple(grads[i].shape) for i in indices], world,
                self.pool.alignment_elements(dtype), [dims[i] for i in indices], tail)
        plan = [(dtype, indices, layout(dtype, indices), None)
                for dtype, indices in self._groups(grads)]
        if tag is not None and plan:
            smallest = min(range(len(plan)),
                           key=lambda k: (plan[k][2].total_numel, plan[k][2].data_numel))
            dtype, indices, _, _ = plan[smallest]
            plan[smallest] = (dtype, indices, layout(dtype, indices, tag.numel), tag)
        return plan

    # -- pack / accumulate / launch ---------------------------------------------------------------
    def pack(self, grads: Sequence[ms.Tensor], shard_dims: Optional[Sequence[int]] = None,
             world_size: Optional[int] = None, allow_borrow: bool = True,
             tag: Optional[RowTag] = None) -> list[PackedBucket]:
        """Lease buckets and copy ``grads`` in (or borrow them, with zero-copy where allowed);
        ``tag``: one bucket reserves row tails for it, filled when it is launched."""
        plan = self._plan(grads, shard_dims, world_size, tag)
        buckets, taken = [], []
        try:
            for dtype, indices, layout, bucket_tag in plan:
                buckets.append(self._pack_one(grads, dtype, indices, layout, allow_borrow, taken,
                                              bucket_tag))
        except BaseException:
            self.discard(buckets)
            self._settle(taken, [])
            raise
        return buckets

    def accumulate(self, buckets: list[PackedBucket], grads: Sequence[ms.Tensor]) -> None:
        """Add a micro-step's ``grads`` (the packed gradients, in order) into already packed
        buckets, no new lease; everything is checked before the first bucket changes."""
        expected = sum(len(bucket.indices) for bucket in buckets)
        if len(grads) != expected:
            raise InvalidArgumentError(
                f"accumulate got {len(grads)} gradients for buckets packed from {expected}; "
                "pass the micro-step's gradients of exactly the packed parameters, in order")
        _check_tensors(grads)
        for bucket in buckets:
            if bucket.lease is None:
                raise LeaseStateError("cannot accumulate into a borrowed gradient; pack with "
                                      "allow_borrow=False for gradient accumulation")
            if bucket.lease.released:
                raise LeaseStateError("cannot accumulate into a bucket that was launched or "
                                      "discarded; pack the next micro-step anew")
            for slot, index in zip(bucket.layout.slots, bucket.indices):
                if tuple(grads[index].shape) != slot.shape:
                    raise LayoutMismatchError(
                        f"gradient {index} has shape {tuple(grads[index].shape)}; it was packed "
                        f"as {slot.shape}")
        for bucket in buckets:
            self._copy_in(self.writer.accumulate, bucket.lease,
                          [grads[i] for i in bucket.indices], bucket.layout)

    def launch(self, buckets: list[PackedBucket], op: str = "avg", count: Optional[int] = None,
               all_reduce: bool = False, across_replicas: bool = True) -> ReduceResult:
        """Start the collective of every bucket and release the inputs fenced on it.
        ``across_replicas=False`` skips the replicate-group all-reduce (HSDP)."""
        try:
            check_reduce_op(op)
        except InvalidArgumentError:
            self.discard(buckets)
            raise
        for bucket in buckets:
            if bucket.borrowed is None and (bucket.lease is None or bucket.lease.released):
                self.discard(buckets)
                raise LeaseStateError(
                    "a bucket handed to launch() was launched or discarded already; pack anew")
        total = count if count is not None else sum(len(b.indices) for b in buckets)
        result = ReduceResult(count=total)
        taken: list[Lease] = []
        for position, bucket in enumerate(buckets):
            try:
                self._launch_one(result, bucket, op, all_reduce, across_replicas, taken)
            except BaseException:
                # this bucket may be in flight already: its input goes back fenced like the rest
                rest = buckets[position:]
                self._abandon(result, taken + [b.lease for b in rest if b.lease is not None])
                for unlaunched in rest:
                    unlaunched.borrowed = None
                raise
        return result

    def discard(self, buckets: list[PackedBucket]) -> None:
        """Give back packed buckets that will not be launched (nothing was in flight)."""
        for bucket in buckets:
            if bucket.lease is not None and not bucket.lease.released:
                bucket.lease.release()
            bucket.borrowed = None

    # -- one-call forms -------------------------------------------------------------------------
    def reduce_scatter(self, grads: Sequence[ms.Tensor], shard_dims: Optional[Sequence[int]] = None,
                       op: str = "avg", across_replicas: bool = True,
                       tag: Optional[RowTag] = None) -> ReduceResult:
        """Reduce-scatter ``grads``; ``wait()`` gives this rank's shard of each, in order."""
        return self._reduce(grads, shard_dims, None, op, False, across_replicas, tag=tag)

    def all_reduce(self, grads: Sequence[ms.Tensor], op: str = "avg",
                   across_replicas: bool = True, tag: Optional[RowTag] = None) -> ReduceResult:
        """All-reduce whole gradients (replicated parameters) in pool buckets."""
        return self._reduce(grads, None, 1, op, True, across_replicas, tag=tag)

    def all_reduce_replicas(self, grads: Sequence[ms.Tensor], op: str = "avg",
                            tag: Optional[RowTag] = None) -> ReduceResult:
        """HSDP: all-reduce already reduce-scattered shard gradients across the replicas only
        (in pool buckets): the second half of a reduce whose first half ran earlier."""
        if self.replicate_comm is None:
            raise InvalidArgumentError("all_reduce_replicas needs a replicate group of 2 or more "
                                       "ranks (GradReducer(replicate_comm=...))")
        return self._reduce(grads, None, 1, op, True, across_replicas=False,
                            comm=self.replicate_comm, tag=tag)

    # -- internals ------------------------------------------------------------------------------
    def _reduce(self, grads, shard_dims, world_size, op: str, all_reduce: bool,
                across_replicas: bool, comm: Optional[Communicator] = None,
                tag: Optional[RowTag] = None) -> ReduceResult:
        """Pack and launch bucket by bucket: each input bucket is released (fenced) before the
        next one is packed, so a bucket whose collective has completed serves the next one."""
        check_reduce_op(op)
        plan = self._plan(grads, shard_dims, world_size, tag)
        result = ReduceResult(count=len(grads))
        taken: list[Lease] = []      # every lease this call acquired, whatever happens next
        try:
            for dtype, indices, layout, bucket_tag in plan:
                bucket = self._pack_one(grads, dtype, indices, layout, not all_reduce, taken,
                                        bucket_tag)
                self._launch_one(result, bucket, op, all_reduce, across_replicas, taken, comm)
        except BaseException:
            self._abandon(result, taken)
            raise
        return result

    def _abandon(self, result: ReduceResult, taken: list[Lease]) -> None:
        """Undo a pack-and-launch that stopped part-way (an error, or an interrupt at any
        instant): the launched outputs go back fenced on their collectives, and every other lease
        it took only once those have completed, since one of them may be a launched input."""
        result.release()
        self._settle(taken, [item.handle for item in result.launched])

    @staticmethod
    def _settle(taken: list[Lease], handles: list) -> None:
        """Release what in ``taken`` is still live, fenced on every one of ``handles``."""
        live = [lease for lease in taken if not lease.released]
        if not live:
            return
        # A collective whose launch returned just as the interrupt came has no recorded handle:
        # once the device has drained, it is done.
        synchronize()
        fence = _AllOf(handles) if handles else None
        for lease in live:
            lease.release(fence)

    def _pack_one(self, grads, dtype, indices: list[int], layout: ReduceScatterLayout,
                  allow_borrow: bool, taken: list[Lease],
                  tag: Optional[RowTag] = None) -> PackedBucket:
        members = [grads[i] for i in indices]
        if allow_borrow and self._can_borrow(members, layout, dtype):   # never a tagged layout
            self.borrows += 1
            return PackedBucket(indices, layout, dtype, borrowed=packing.flat_view(members[0]))
        lease = self.pool.acquire(layout.total_numel, dtype, holder=taken)
        self._copy_in(self.writer.pack, lease, members, layout)
        return PackedBucket(indices, layout, dtype, lease=lease, tag=tag)

    def _launch_one(self, result: ReduceResult, bucket: PackedBucket, op: str,
                    all_reduce: bool, across_replicas: bool, taken: list[Lease],
                    comm: Optional[Communicator] = None) -> None:
        """Start ``bucket``'s collective (over ``comm``, default the shard group), recorded in
        ``result`` at once so that whatever stops the caller knows it is in flight."""
        comm = comm if comm is not None else self.comm
        numel = bucket.layout.total_numel
        if bucket.tag is not None:      # written last: a micro-step's accumulate adds no tail
            packing.write_row_tails(bucket.lease.tensor, bucket.layout,
                                    bucket.tag.values(bucket.dtype), bucket.lease.allocation)
        if all_reduce:
            handle = _Collective(comm.all_reduce(bucket.lease.tensor, op=op, async_op=True),
                                 _describe("all_reduce", bucket, numel, comm))
            # the bucket is reduced in place: it is its own output
            result.launched.append(_Launched(bucket, bucket.lease, handle))
            output = bucket.lease
        else:
            output = self.pool.acquire(bucket.layout.row_numel, bucket.dtype, holder=taken)
            handle = _Collective(comm.reduce_scatter(output.tensor, bucket.input_tensor,
                                                     op=op, async_op=True),
                                 _describe("reduce_scatter", bucket, numel, comm))
            result.launched.append(_Launched(bucket, output, handle))
            if bucket.lease is not None:
                bucket.lease.release(handle)     # recycled only once the collective completed
        if across_replicas and self.replicate_comm is not None:
            # HSDP: the replicas' outputs are all-reduced next, on pool memory too. It reads what
            # the first collective wrote, so it is ordered after it (on Ascend a stream wait).
            first = result.launched[-1]
            first.handle.wait()
            second = _Collective(
                self.replicate_comm.all_reduce(output.tensor, op=op, async_op=True),
                _describe("replica all_reduce", bucket, output.numel, self.replicate_comm))
            first.handle = _Chain(first.handle, second)

    def _copy_in(self, write, lease: Lease, grads, layout: ReduceScatterLayout) -> None:
        """Run one pack or accumulate and account it in the pool's statistics."""
        timed = self.pool.timed_copies
        if timed:
            synchronize()       # so the clock measures this copy, not backward work still queued
        start = time.perf_counter()
        written = write(lease, grads, layout)
        if timed and not written.on_host:
            synchronize()       # device writes are queued; NumPy writes are done on return
        self.pool.record_copy(written.nbytes, time.perf_counter() - start, written.padding_bytes)

    def _can_borrow(self, members, layout: ReduceScatterLayout, dtype) -> bool:
        return self.config.zero_copy and layout.is_identity() and members[0].dtype == dtype \
            and members[0].is_contiguous()
