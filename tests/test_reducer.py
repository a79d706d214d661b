"""GradReducer at world size 1, in-process (SingleProcessCommunicator, no msrun).

Part 1 runs the cases of tests/distributed/reducer_cases.py here, one test per case, with the
same NumPy references the 2-rank launch uses (tests/test_reducer_distributed.py); a few run again
on gradpool.pack's device path.
Part 2 holds what only needs one process: argument errors, the shard-view lifetime contract,
idempotent release, and the pool's steady state over repeated reductions.
Part 3 simulates a second rank in-process (``simulated.PeerScaled``): ops and shard dims at two
ranks, replicas, launches and packs that raise and leak no lease, copy statistics, discard.
Part 4 is the reducer under what a demanding user does (handles with wait() only, Ctrl-C at
random instants), and the reducer's table of the bad-input matrix.
"""
from __future__ import annotations

import gc
import random
import sys
import time
import types
import weakref
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms

from gradpool.comm import Communicator, SingleProcessCommunicator
from gradpool.testing import FaultInjectingCommunicator
from gradpool.errors import CollectiveError, InvalidArgumentError, LeaseStateError
from gradpool.layout import ReduceScatterLayout
from gradpool.dtypes import itemsize
from gradpool import pool as pool_module
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig
from bad_inputs import REDUCER_CASES, assert_refused_typed
from npref import np_chunk, values
from pool_checks import (Interrupt, QuarantineWatch, assert_consistent, assert_reduces_correctly,
                         step_grads)
from simulated import PeerScaled, WaitOnlyHandle, make_reducer, random_grads

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402
import reducer_cases as cases  # noqa: E402  (the rank-side cases and their NumPy references)

SUITE = cases.suite

ms.set_device("CPU")

SHAPES, SHARD_DIMS = cases.SHAPES, cases.SHARD_DIMS
CTX = harness.Context(rank=0, world_size=1, comm=SingleProcessCommunicator())


# -- part 1: the distributed cases, world size 1 ----------------------------------------------
# With one rank "sum" and "avg" are the same reduction (SingleProcessCommunicator ignores op), so
# the "sum" twin of every parametrized case is left to the 2-rank run, and so are the fully_shard
# cases that launch adds (one process gathers nothing to prefetch; tests/test_fully_shard.py runs
# fully_shard at world size 1).
WORLD_1_NAMES = [name for name in SUITE.names
                 if "_sum_" not in name and name not in cases.FULLY_SHARD_ASYNC]


@pytest.mark.parametrize("name", WORLD_1_NAMES)
def test_case_world_size_1(name, tmp_path, monkeypatch):
    # One process has no rank skew to absorb: a shorter in-flight window keeps this file fast.
    monkeypatch.setattr(cases, "DELAY", 0.2)
    SUITE.main([str(tmp_path), name])           # outside msrun: SingleProcessCommunicator
    results = harness.load_results(tmp_path, SUITE.name, nproc=1)
    assert results.reports[0]["world_size"] == 1
    results.verify(name)


@pytest.mark.parametrize("name", [
    "reduce_scatter_sum_reduce_float32_grad_float32_fused_small_cap",
    "reduce_scatter_avg_reduce_float16_grad_float32_pergrad",
    "accumulate_sum_reduce_float32_grad_float32_fused_small_cap",
    "zero_copy_borrows_identity_layout",
])
def test_case_world_size_1_device_copies(name, tmp_path, monkeypatch):
    """float32/float16 packs take gradpool.pack's NumPy host path on CPU; these cases again on the
    device (Ascend-portable) path."""
    monkeypatch.setattr(cases, "HOST_COPIES", False)
    SUITE.main([str(tmp_path), name])
    harness.load_results(tmp_path, SUITE.name, nproc=1).verify(name)


# -- part 2 --------------------------------------------------------------------------------------
def reducer(pool=None, **config) -> GradReducer:
    return GradReducer(pool or BucketPool(poison_on_release=True), SingleProcessCommunicator(),
                       ReducerConfig(**config))


def grads(dtype=ms.float32, seed=1):
    return cases.make_grads(CTX, SHAPES, dtype, seed)


def assert_shards(shards, op, seed, dtype, shapes=SHAPES):
    """Exactly the NumPy reference: float32 gradients rounded once into ``dtype``."""
    fulls = cases.reduced(CTX, shapes, op, [seed], ms.float32, dtype)
    assert len(shards) == len(fulls)
    for shard, full, dim in zip(shards, fulls, SHARD_DIMS):
        assert shard.dtype == dtype
        np.testing.assert_array_equal(harness.to_numpy(shard), cases.expected_shard(full, dim, 0, 1))


@pytest.mark.parametrize("call", ["reduce_scatter", "all_reduce", "launch"])
@pytest.mark.parametrize("op", ["max", "mean", "SUM", ""])
def test_bad_op_raises_naming_it(call, op):
    red = reducer()
    g = grads()
    with pytest.raises(InvalidArgumentError, match=repr(op)) as info:
        if call == "launch":
            red.launch(red.pack(g, SHARD_DIMS), op=op)    # refused launch gives the buckets back
        else:
            getattr(red, call)(g, op=op)
    assert "sum" in str(info.value) and "avg" in str(info.value)   # says what is accepted
    stats = red.pool.stats()
    assert stats.live_leases == 0
    if call != "launch":
        assert stats.new_allocations == 0          # rejected before anything was leased


@pytest.mark.parametrize("reduce_dtype", [ms.float32, ms.bfloat16], ids=str)
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "pergrad"])
def test_shard_views_live_in_output_lease_until_release(reduce_dtype, fusion):
    """The lifetime contract: wait() hands out views of a pool output lease; the lease stays live
    while the caller holds the result, and after release() the pool may reuse (here: poisons) it,
    so a view kept past release() reads NaN. Consume the shards before release()."""
    pool = BucketPool(poison_on_release=True)
    red = reducer(pool, reduce_dtype=reduce_dtype, comm_fusion=fusion)
    result = red.reduce_scatter(grads(seed=1), SHARD_DIMS, op="sum")
    shards = result.wait()
    assert result.wait() is shards                     # wait() is repeatable, same views
    buckets = 1 if fusion else len(SHAPES)
    assert pool.stats().live_leases == buckets
    # Another reduce on the same pool while the shards are held must not take their bucket.
    other = red.reduce_scatter(grads(seed=2), SHARD_DIMS, op="sum")
    assert_shards(other.wait(), "sum", 2, reduce_dtype)
    other.release()
    assert pool.stats().live_leases == buckets
    assert_shards(shards, "sum", 1, reduce_dtype)
    result.release()
    assert pool.stats().live_leases == 0
    for shard in shards:                               # the old views now read poison
        assert np.isnan(harness.to_numpy(shard)).all()
    with pytest.raises(LeaseStateError, match="released"):
        result.wait()


def test_release_is_idempotent():
    pool = BucketPool(poison_on_release=True)
    red = reducer(pool, comm_fusion=True)
    result = red.reduce_scatter(grads(), SHARD_DIMS, op="avg")
    result.wait()
    result.release()
    once = pool.stats()
    result.release()
    result.release()
    assert pool.stats() == once
    assert (once.live_leases, once.fenced_buckets, once.free_buckets) == (0, 0, 2)
    # A released bucket is in the free list once: two acquires of its size get two buckets.
    a = pool.acquire(16, ms.float32)
    b = pool.acquire(16, ms.float32)
    c = pool.acquire(16, ms.float32)
    assert len({cases.storage_ptr(x.tensor) for x in (a, b, c)}) == 3
    assert pool.stats().new_allocations == once.new_allocations + 1


def test_release_without_wait_returns_the_output_buckets():
    pool = BucketPool()
    red = reducer(pool)
    red.reduce_scatter(grads(), SHARD_DIMS).release()
    stats = pool.stats()
    assert (stats.live_leases, stats.fenced_buckets) == (0, 0)


def _bucket_bytes(numel: int, dtype, pool: BucketPool) -> int:
    align = pool.alignment_bytes
    return -(-numel * itemsize(dtype) // align) * align


@pytest.mark.parametrize("reduce_dtype, in_flight",
                         [(ms.float32, 1), (ms.bfloat16, 1), (ms.float32, 2)], ids=str)
def test_repeated_reduce_reaches_steady_state(reduce_dtype, in_flight):
    """50 identical fused reductions: after the first, no allocation; the high-water mark is the
    layout's input bucket plus one output bucket per result held. (World size 1: the collective
    has completed when launch returns, so each input bucket is recycled at once and the next
    reduction's input reuses it; only output buckets accumulate with results in flight.)"""
    pool = BucketPool(poison_on_release=True)
    red = reducer(pool, reduce_dtype=reduce_dtype, comm_fusion=True)
    shapes, dims = SHAPES[:3], SHARD_DIMS[:3]
    g = grads(seed=3)[:3]
    layout = ReduceScatterLayout.build(shapes, 1, pool.alignment_elements(reduce_dtype), dims)
    in_bytes = _bucket_bytes(layout.total_numel, reduce_dtype, pool)
    out_bytes = _bucket_bytes(layout.row_numel, reduce_dtype, pool)
    held = []
    after_first = None
    for step in range(50):
        held.append(red.reduce_scatter(g, dims, op="avg"))
        if len(held) == in_flight:
            oldest = held.pop(0)
            if step % 10 == 0:
                shards = oldest.wait()
                assert len(shards) == 3
                assert_shards(shards, "avg", 3, reduce_dtype, shapes)
            oldest.release()
        if step == in_flight - 1:
            after_first = pool.stats()
    stats = pool.stats()
    assert stats.new_allocations == after_first.new_allocations == 1 + in_flight
    assert stats.reuses == 2 * 50 - stats.new_allocations
    assert stats.stalls == 0
    assert stats.high_water_bytes == stats.bytes_reserved == in_bytes + in_flight * out_bytes
    for result in held:
        result.release()
    assert pool.stats().live_leases == 0


def test_repeated_per_gradient_reduce_allocates_only_once():
    pool = BucketPool()
    red = reducer(pool, reduce_dtype=ms.float32)
    g = grads(seed=4)[:3]
    for step in range(50):
        result = red.reduce_scatter(g, SHARD_DIMS[:3], op="sum")
        if step in (0, 49):
            shards = result.wait()
            assert len(shards) == 3
            assert_shards(shards, "sum", 4, ms.float32, SHAPES[:3])
        result.release()
        if step == 0:
            first = pool.stats()
    stats = pool.stats()
    assert stats.new_allocations == first.new_allocations
    assert stats.high_water_bytes == first.high_water_bytes == stats.bytes_reserved


def test_zero_copy_borrow_outlives_a_release_before_completion():
    """release() while the collective still reads a borrowed gradient (no wait(), or another
    bucket's wait() failed): the borrow is held, with the output bucket's fence, until the
    collective completes; then the pool drops it. The gradient itself is never touched."""
    pool = BucketPool(alignment_bytes=cases.ZC_ALIGN_BYTES, poison_on_release=True)
    # launch mode: the collective has run, so only the reducer and the pool can hold the borrow
    # (a read_input_at="wait" handle holds its input until it runs). 2 s: gc.collect() on a loaded
    # machine can take longer than a short delay, and then the handle would already be complete.
    faulty = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=2.0)
    red = GradReducer(pool, faulty, ReducerConfig(reduce_dtype=ms.float32, zero_copy=True))
    grad = cases.make_grads(CTX, [cases.IDENTITY_SHAPE], ms.float32, seed=5)[0]
    before = cases.fingerprint(grad)
    buckets = red.pack([grad])
    assert buckets[0].lease is None and buckets[0].borrowed is not None    # really borrowed
    borrow = weakref.ref(buckets[0].borrowed)
    result = red.launch(buckets, op="sum")
    del buckets
    result.release()
    gc.collect()
    assert not result.is_completed()
    assert borrow() is not None, "borrow dropped while its collective was still in flight"
    assert pool.stats().fenced_buckets == 1        # the output bucket waits for the collective
    pool.wait_all()
    gc.collect()
    assert borrow() is None, "the pool kept the borrow after the collective completed"
    assert pool.stats().fenced_buckets == 0
    assert cases.fingerprint(grad) == before


def test_every_wait_on_a_failed_result_sees_the_collective_error():
    """A fused result is waited on by each of its parameters: all of them get the same typed
    error, naming the collective, with the real cause."""
    pool = BucketPool(poison_on_release=True)
    failure = RuntimeError("link down")
    red = GradReducer(pool, FaultInjectingCommunicator(SingleProcessCommunicator(),
                                                       fail_wait=failure),
                      ReducerConfig(comm_fusion=True))
    result = red.reduce_scatter(grads(), SHARD_DIMS, op="avg")
    errors = []
    for _ in range(3):
        with pytest.raises(CollectiveError) as info:
            result.wait()
        errors.append(info.value)
    assert errors[0] is errors[1] is errors[2] and errors[0].__cause__ is failure
    assert errors[0].collective.startswith("reduce_scatter of 6 gradient(s) [0, 1, 2, 3, 4, 5]")
    assert pool.stats().live_leases == 0


@pytest.mark.parametrize("fault", ["fail_wait", "fail_is_completed"])
@pytest.mark.parametrize("late", [False, True], ids=["at_launch", "at_wait"])
def test_a_failed_collective_quarantines_its_buckets_and_never_recycles_them(fault, late,
                                                                             monkeypatch):
    """Both buckets of the failed collective (its input, fenced on it, and its output) are
    quarantined, never leased again by the next reduces, which give NumPy's values in new
    buckets; trim() frees them after a synchronize. The caller gets a CollectiveError naming the
    reduce-scatter, its cause the injected error."""
    pool = BucketPool(alignment_bytes=4, poison_on_release=True)
    injected = RuntimeError("link down 17")
    comm = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.05,
                                      read_input_at="wait" if late else "launch",
                                      **{fault: injected})
    reducer = GradReducer(pool, comm, ReducerConfig(comm_fusion=True))
    watch = QuarantineWatch(pool)
    arrays, tensors = step_grads(3)
    result = reducer.reduce_scatter(tensors, op="sum")
    with pytest.raises(CollectiveError) as info:
        result.wait()
    assert info.value.__cause__ is injected and "link down 17" in str(info.value)
    assert info.value.collective.startswith("reduce_scatter of 3 gradient(s) [0, 1, 2]")
    stats = pool.stats()
    assert (stats.live_leases, stats.quarantined_buckets, stats.failed_fences) == (0, 2, 2)
    bad = [b for b in pool._buckets if b.state == "quarantined"]
    assert watch.check() == 2
    setattr(comm, fault, None)                    # the fault clears
    for seed in (4, 5):
        arrays, tensors = step_grads(seed)
        result = reducer.reduce_scatter(tensors, op="sum")
        for shard, want in zip(result.wait(), arrays):
            np.testing.assert_array_equal(shard.asnumpy(), want)
        result.release()
        watch.check()
    pool.wait_all()
    assert pool.stats().quarantined_buckets == 2 and watch.check() == 2
    synced = []
    monkeypatch.setattr(pool_module, "synchronize",
                        lambda: synced.append([b.tensor.untyped_storage().size() for b in bad]))
    pool.trim()
    assert synced == [[b.nbytes for b in bad]] and pool.stats().quarantined_buckets == 0
    watch.check()
    assert_consistent(pool, held=0)


# -- part 3: a second rank simulated in-process ---------------------------------------------------
@pytest.mark.parametrize("op, factor", [("sum", 4.0), ("avg", 2.0)])
def test_reduce_scatter_at_two_ranks_keeps_op_and_shard_dims(op, factor):
    """Rank 0's shard of each gradient, chunked on its own shard dim, reduced with the op asked
    for (NumPy's chunk of the gradient times the simulated reduction)."""
    shapes, dims = [(4, 6), (5,), (3, 5)], [1, 0, 1]
    raw, grads = random_grads(shapes, 21)
    reducer = make_reducer(PeerScaled())
    result = reducer.reduce_scatter(grads, shard_dims=dims, op=op)
    for shard, full, dim in zip(result.wait(), raw, dims):
        np.testing.assert_array_equal(values(shard), factor * np_chunk(full, dim, 0, 2))
    result.release()
    assert reducer.comm.async_ops == [True] * 3, "every collective is launched asynchronously"
    packed = reducer.pack(grads, shard_dims=dims, world_size=2)
    assert [s.shard_dim for b in packed for s in b.layout.slots] == dims
    reducer.discard(packed)


def test_all_reduce_averages_by_default():
    raw, grads = random_grads([(3, 4), (6,)], 22)
    comm = PeerScaled()
    result = make_reducer(comm).all_reduce(grads)
    for reduced, full in zip(result.wait(), raw):
        np.testing.assert_array_equal(values(reduced).reshape(full.shape), 2.0 * full)
    result.release()
    assert comm.async_ops == [True, True], "every collective is launched asynchronously"


def test_replicas_are_all_reduced_once_and_only_when_asked():
    """HSDP on a 1-rank shard group and a simulated 2-rank replicate group: reduce_scatter
    all-reduces the replicas by default (avg: x2 here), not with across_replicas=False, and
    all_reduce_replicas all-reduces once (sum: x4, not x16)."""
    raw, grads = random_grads([(4, 3), (5,)], 23)
    reducer = make_reducer(replicate=PeerScaled())
    for kwargs, factor in ((dict(), 2.0), (dict(across_replicas=False), 1.0)):
        result = reducer.reduce_scatter(grads, **kwargs)
        for shard, full in zip(result.wait(), raw):
            np.testing.assert_array_equal(values(shard), factor * full)
        result.release()
    for call, factor in ((lambda: reducer.all_reduce_replicas(grads, op="sum"), 4.0),
                         (lambda: reducer.all_reduce_replicas(grads), 2.0),
                         (lambda: reducer.all_reduce(grads), 2.0)):    # replicated parameters
        result = call()
        for reduced, full in zip(result.wait(), raw):
            np.testing.assert_array_equal(values(reduced).reshape(full.shape), factor * full)
        result.release()


def test_a_one_rank_replicate_group_is_no_replicate_group():
    reducer = make_reducer(replicate=SingleProcessCommunicator())
    assert reducer.replicate_comm is None
    raw, grads = random_grads([(4,)], 24)
    with pytest.raises(InvalidArgumentError) as err:
        reducer.all_reduce_replicas(grads)
    assert str(err.value) == ("all_reduce_replicas needs a replicate group of 2 or more ranks "
                              "(GradReducer(replicate_comm=...))")


def test_a_gradient_that_is_no_tensor_is_refused_naming_the_fix():
    reducer = make_reducer(PeerScaled())
    with pytest.raises(InvalidArgumentError) as err:
        reducer.reduce_scatter([np.zeros(4, np.float32)])
    assert str(err.value) == ("gradient 0 is a ndarray, not a mindspore Tensor; convert it with "
                              "mindspore.Tensor(...)")
    assert reducer.pool.stats().new_allocations == 0


def test_a_bucket_filled_exactly_to_the_fusion_cap_stays_one_bucket():
    """comm_fusion packs gradients into one bucket while they fit the cap, the cap itself
    included: 32 + 32 bytes under a 64-byte cap are one bucket, the next gradient another."""
    raw, grads = random_grads([(8,), (8,), (1,)], 38)
    reducer = make_reducer(PeerScaled(), comm_fusion=True, bucket_cap_mib=64 / 2 ** 20)
    packed = reducer.pack(grads, allow_borrow=False)
    assert [b.indices for b in packed] == [[0, 1], [2]]
    reducer.discard(packed)


def _no_live_leases_then_a_correct_reduce(reducer, raw, grads):
    """After a failed reduce every bucket is back (none leased), and the next reduce through
    the same pool gives NumPy's values."""
    reducer.pool.wait_all()
    stats = reducer.pool.stats()
    assert stats.new_allocations > 0
    assert (stats.live_leases, stats.free_buckets) == (0, stats.new_allocations)
    result = reducer.reduce_scatter(grads, op="sum")
    for shard, full in zip(result.wait(), raw):
        np.testing.assert_array_equal(values(shard), 4.0 * np_chunk(full, 0, 0, 2))
    result.release()


def test_a_launch_that_raises_surfaces_its_error_and_leaks_no_lease():
    raw, grads = random_grads([(4, 3), (6,)], 25)
    comm = PeerScaled(fail_at=2)
    reducer = make_reducer(comm)
    with pytest.raises(RuntimeError, match="launch 2 failed"):
        reducer.reduce_scatter(grads, op="sum")
    _no_live_leases_then_a_correct_reduce(reducer, raw, grads)


def test_a_pack_that_raises_leaks_no_lease(monkeypatch):
    raw, grads = random_grads([(4, 3), (6,)], 26)
    reducer = make_reducer(PeerScaled())

    def broken_pack(*args, **kwargs):
        raise RuntimeError("pack failed")

    monkeypatch.setattr(reducer, "writer", types.SimpleNamespace(pack=broken_pack))
    with pytest.raises(RuntimeError, match="pack failed"):
        reducer.reduce_scatter(grads, op="sum")
    monkeypatch.undo()
    _no_live_leases_then_a_correct_reduce(reducer, raw, grads)


def test_a_failed_launch_or_pack_of_the_two_step_api_surfaces_its_error_and_leaks_no_lease(
        monkeypatch):
    """pack() then launch(): a pack that raises, and a launch whose second collective raises,
    give back every bucket and let their own error through."""
    raw, grads = random_grads([(4, 3), (6,)], 37)
    reducer = make_reducer(PeerScaled(fail_at=2))
    packed = reducer.pack(grads, allow_borrow=False)
    with pytest.raises(RuntimeError, match="launch 2 failed"):
        reducer.launch(packed, op="sum")
    real = reducer.writer.pack
    calls = []

    def pack_then_fail(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("pack failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(reducer, "writer", types.SimpleNamespace(pack=pack_then_fail))
    with pytest.raises(RuntimeError, match="pack failed"):
        reducer.pack(grads, allow_borrow=False)
    monkeypatch.undo()
    reducer.comm.fail_at = None
    _no_live_leases_then_a_correct_reduce(reducer, raw, grads)


def test_leases_left_by_a_failed_launch_wait_for_the_collectives_in_flight():
    """The first bucket's collective is still in flight when the second launch raises: what the
    failed call still held goes back fenced on it, so none of those buckets is leased again
    before that collective completes."""
    raw, grads = random_grads([(4, 3), (6,)], 27)
    comm = PeerScaled(fail_at=2, pending=True)
    reducer = make_reducer(comm)
    with pytest.raises(RuntimeError, match="launch 2 failed"):
        reducer.reduce_scatter(grads, op="sum")
    stats = reducer.pool.stats()
    assert (stats.live_leases, stats.free_buckets, stats.fenced_buckets) == (0, 0, 4)
    comm.pending = False
    _no_live_leases_then_a_correct_reduce(reducer, raw, grads)


def test_reducer_statistics_time_the_copies_within_the_call():
    """The pool's copy statistics after one reduce: the bytes of both packed buckets (padding
    included) and a copy time inside the call's own duration."""
    shapes = [(64, 8), (33,)]
    raw, grads = random_grads(shapes, 28)
    reducer = make_reducer(PeerScaled())
    start = time.perf_counter()
    reducer.reduce_scatter(grads, op="sum").release()
    elapsed = time.perf_counter() - start
    stats = reducer.pool.stats()
    assert stats.bytes_copied == sum(4 * ReduceScatterLayout.build([s], 2).total_numel
                                     for s in shapes)
    assert 0 < stats.copy_seconds <= elapsed


def test_discard_takes_borrowed_and_already_discarded_buckets():
    """discard gives back what it can and ignores the rest: a zero-copy borrow holds no lease,
    a second discard finds the lease released."""
    raw, grads = random_grads([(8, 4)], 29)
    reducer = make_reducer(PeerScaled(), zero_copy=True)
    borrowed = reducer.pack(grads)
    assert borrowed[0].lease is None and borrowed[0].borrowed is not None
    reducer.discard(borrowed)
    assert borrowed[0].borrowed is None
    packed = reducer.pack(grads, allow_borrow=False)
    reducer.discard(packed)
    reducer.discard(packed)
    assert packed[0].lease.released and reducer.pool.stats().live_leases == 0
    np.testing.assert_array_equal(raw[0], grads[0].astype(ms.float32).asnumpy())


def test_accumulate_into_a_launched_bucket_is_refused_naming_the_fix():
    raw, grads = random_grads([(4, 3)], 30)
    reducer = make_reducer(PeerScaled())
    packed = reducer.pack(grads, allow_borrow=False)
    reducer.launch(packed, op="sum").release()
    with pytest.raises(LeaseStateError) as err:
        reducer.accumulate(packed, grads)
    assert str(err.value) == ("cannot accumulate into a bucket that was launched or discarded; "
                              "pack the next micro-step anew")


# -- part 4: handles with wait() only, Ctrl-C at random instants ----------------------------------
class WaitOnlyCommunicator(Communicator):
    """A single-process communicator whose handles have wait() only."""

    def __init__(self):
        self.inner = SingleProcessCommunicator()
        self.handles = []

    rank = property(lambda self: 0)
    world_size = property(lambda self: 1)

    def _hand(self, _inner):
        handle = WaitOnlyHandle()
        self.handles.append(handle)
        return handle

    def _reduce_scatter(self, output, input, op, async_op):
        return self._hand(self.inner.reduce_scatter(output, input, op))

    def _all_gather(self, output, input, async_op):
        return self._hand(self.inner.all_gather(output, input))

    def _all_reduce(self, tensor, op, async_op):
        return self._hand(self.inner.all_reduce(tensor, op))


def test_the_reducer_waits_wait_only_handles_and_then_recycles():
    comm = WaitOnlyCommunicator()
    pool = BucketPool(alignment_bytes=4, poison_on_release=True)
    reducer = GradReducer(pool, comm, ReducerConfig(comm_fusion=True))
    arrays, tensors = step_grads(1)
    result = reducer.reduce_scatter(tensors, op="sum")
    assert pool.stats().fenced_buckets == 1, "the input waits for its collective"
    for shard, want in zip(result.wait(), arrays):
        np.testing.assert_array_equal(shard.asnumpy(), want)
    assert all(h.waits == 1 for h in comm.handles)
    assert pool.stats().fenced_buckets == 0, "waited through the reducer: recycled"
    result.release()
    assert pool.stats().live_leases == 0


@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "pergrad"])
def test_interrupts_at_random_instants_leave_the_pool_consistent(fusion):
    """Hundreds of seeded random Ctrl-Cs through acquire-at-bound (delayed collectives, one bucket
    in flight), poisoning, lease creation and ReduceResult.release(); every fifth step's
    collectives fail (wait() or is_completed() raising): their buckets are quarantined and never
    leased again, whatever the interrupts hit, and the step sees a CollectiveError."""
    rng = random.Random(1234 if fusion else 4321)
    pool = BucketPool(alignment_bytes=4, poison_on_release=True, max_buckets_in_flight=1)
    comm = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.002)
    reducer = GradReducer(pool, comm, ReducerConfig(comm_fusion=fusion))
    watch = QuarantineWatch(pool)
    injected = RuntimeError("injected link failure")
    interrupt = Interrupt()
    interrupted = failed = 0
    try:
        for step in range(300):
            arrays, tensors = step_grads(step)
            failing = step % 5 == 2
            comm.fail_wait = injected if failing and step % 2 else None
            comm.fail_is_completed = injected if failing and not step % 2 else None
            result = None
            delay = rng.uniform(0.00002, 0.004)
            try:
                if not (failing and step % 3 == 0):     # a third of the failures run whole
                    interrupt.arm(delay)
                result = reducer.reduce_scatter(tensors, op="sum")
                shards = result.wait()
                got = [s.asnumpy().copy() for s in shards]
                result.release()
                interrupt.disarm()
                assert not failing, "a failed collective's result was returned"
                for shard, want in zip(got, arrays):
                    np.testing.assert_array_equal(shard, want)
            except KeyboardInterrupt:
                interrupted += 1
            except CollectiveError as exc:
                assert failing and exc.__cause__ is injected, exc
                failed += 1
            finally:
                interrupt.disarm()
            if result is not None:
                result.release()        # what a caller holding the result does after Ctrl-C
            assert_consistent(pool, held=0)
            watch.check()
            if step % 50 == 49:
                pool.trim()             # frees the quarantined buckets after a synchronize
                assert pool.stats().quarantined_buckets == 0
        comm.fail_wait = comm.fail_is_completed = None
        pool.wait_all()
        assert_consistent(pool, held=0)
        assert_reduces_correctly(reducer)
        watch.check()
    finally:
        interrupt.close()
    assert interrupted > 50, f"only {interrupted} of 300 iterations were interrupted"
    assert failed >= 20 and len(watch.seen) >= failed, (failed, len(watch.seen))


# -- the reducer's table of the bad-input matrix (tests/bad_inputs.py) ----------------------------
@pytest.mark.parametrize("name", sorted(REDUCER_CASES))
def test_bad_input_is_refused_typed_naming_the_value(name):
    assert_refused_typed(name)
