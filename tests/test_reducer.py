"""GradReducer at world size 1, in-process (SingleProcessCommunicator, no msrun).

Part 1 runs the cases of tests/distributed/reducer_cases.py here, one test per case, with the
same NumPy references the 2-rank launch uses (tests/test_reducer_distributed.py); a few run again
on gradpool.pack's device path.
Part 2 holds what only needs one process: argument errors, the shard-view lifetime contract,
idempotent release, and the pool's steady state over repeated reductions.
"""
from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms

from gradpool.comm import SingleProcessCommunicator
from gradpool.testing import FaultInjectingCommunicator
from gradpool.errors import InvalidArgumentError, LeaseStateError
from gradpool.layout import ReduceScatterLayout
from gradpool.dtypes import itemsize
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig

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
    """A fused result is waited on by each of its parameters: all of them get the real cause."""
    pool = BucketPool(poison_on_release=True)
    failure = RuntimeError("link down")
    red = GradReducer(pool, FaultInjectingCommunicator(SingleProcessCommunicator(),
                                                       fail_wait=failure),
                      ReducerConfig(comm_fusion=True))
    result = red.reduce_scatter(grads(), SHARD_DIMS, op="avg")
    for _ in range(3):
        with pytest.raises(RuntimeError) as info:
            result.wait()
        assert info.value is failure
    assert pool.stats().live_leases == 0
