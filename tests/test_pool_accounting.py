"""The pool's accounting, exactly: what reserve, trim, eviction, an interrupted acquire and a
stall leave in ``stats()``, and what they say. Written against the mutants of ``make mutation``
that the rest of the suite let live (every counter here had a mutant that set instead of added,
or a bound off by one)."""
from __future__ import annotations

import threading
import time

import mindspore as ms
import pytest

from gradpool import pool as pool_module
from gradpool.errors import ForeignLeaseError, PoolCapacityError
from gradpool.pool import BucketPool

ms.set_device("CPU")


class _SlowHandle:
    """A collective that completes ``seconds`` after its wait() is called (it is in flight
    until then); wait() may raise ``error`` once done."""

    def __init__(self, seconds: float, error: Exception | None = None):
        self.seconds, self.error, self.done = seconds, error, False

    def wait(self):
        time.sleep(self.seconds)
        self.done = True
        if self.error is not None:
            raise self.error

    def is_completed(self):
        return self.done


def test_reserve_makes_one_idle_bucket_by_default():
    pool = BucketPool(device="CPU", alignment_bytes=4)
    pool.reserve(ms.float32, 100)
    stats = pool.stats()
    assert (stats.free_buckets, stats.bytes_reserved, stats.new_allocations) == (1, 400, 1)
    lease = pool.acquire(100, ms.float32)
    assert pool.stats().reuses == 1 and pool.stats().new_allocations == 1
    lease.release()


def test_reserve_over_the_cap_is_refused_whole_naming_count_and_bucket_size():
    """3 x 400 bytes under a 1,000-byte cap: refused before anything is allocated; 2 x 400 fits,
    and the count is multiplied in (a third bucket no longer fits beside them)."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=1000)
    with pytest.raises(PoolCapacityError) as err:
        pool.reserve(ms.float32, 100, count=3)
    assert str(err.value).startswith("reserve of 3 x 400 bytes would exceed max_cached_bytes=1000:"
                                     " the pool already caches 0 bytes")
    assert pool.stats().bytes_reserved == 0 and pool.stats().new_allocations == 0
    pool.reserve(ms.float32, 100, count=2)
    assert (pool.stats().free_buckets, pool.stats().bytes_reserved) == (2, 800)
    with pytest.raises(PoolCapacityError):
        pool.reserve(ms.float16, 200)             # 400 more bytes: 1,200 > 1,000
    assert pool.stats().bytes_reserved == 800


def test_trim_adds_up_what_it_frees_and_logs_it(caplog):
    pool = BucketPool(device="CPU", alignment_bytes=4)
    pool.reserve(ms.float32, 100, count=2)
    pool.reserve(ms.float16, 50)
    with caplog.at_level("DEBUG", logger="gradpool.pool"):
        assert pool.trim() == 900
    assert [r.getMessage() for r in caplog.records if "trimmed" in r.getMessage()] == \
        ["trimmed 900 bytes"]
    stats = pool.stats()
    assert (stats.trimmed_bytes, stats.bytes_reserved, stats.free_buckets) == (900, 0, 0)
    pool.reserve(ms.float32, 25)
    assert pool.trim() == 100 and pool.stats().trimmed_bytes == 1000


def test_trim_from_another_thread_frees_nothing_and_says_zero():
    pool = BucketPool(device="CPU", alignment_bytes=4)
    pool.reserve(ms.float32, 100)
    freed = []
    worker = threading.Thread(target=lambda: freed.append(pool.trim()))
    worker.start()
    worker.join()
    assert freed == [0]
    assert pool.stats().bytes_reserved == 400 and pool.stats().trimmed_bytes == 0


def test_copies_recorded_add_up():
    pool = BucketPool(device="CPU")
    pool.record_copy(100, 0.25, 4)
    pool.record_copy(60, 0.5, 0)
    stats = pool.stats()
    assert (stats.bytes_copied, stats.copy_seconds, stats.padding_bytes) == (160, 0.75, 4)


def test_eviction_stops_as_soon_as_the_request_fits_the_cap_exactly():
    """400 + 400 bytes idle under an 800-byte cap; a 400-byte bucket of a third kind fits once
    one of them is evicted (400 + 400 = 800, the cap itself allowed), so the other stays."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=800)
    pool.reserve(ms.float32, 100)
    pool.reserve(ms.float16, 200)
    lease = pool.acquire(200, ms.bfloat16)
    stats = pool.stats()
    assert (stats.trimmed_bytes, stats.bytes_reserved, stats.free_buckets) == (400, 800, 1)
    lease.release()


class _InterruptingLease:
    """Stands in for ``Lease`` and raises as it is made: a Ctrl-C landing inside ``acquire``
    after the bucket was allocated and tracked, before any lease exists."""

    def __init__(self, *args, **kwargs):
        raise KeyboardInterrupt


@pytest.mark.parametrize("before", ["empty pool", "other buckets cached"])
def test_an_interrupted_acquire_forgets_only_the_bucket_it_allocated(monkeypatch, before):
    pool = BucketPool(device="CPU", alignment_bytes=4)
    if before == "other buckets cached":
        pool.reserve(ms.float16, 10, count=2)
    kept = pool.stats()
    monkeypatch.setattr(pool_module, "Lease", _InterruptingLease)
    with pytest.raises(KeyboardInterrupt):
        pool.acquire(100, ms.float32)
    monkeypatch.undo()
    stats = pool.stats()
    assert (stats.bytes_reserved, stats.free_buckets, stats.new_allocations, stats.live_leases) \
        == (kept.bytes_reserved, kept.free_buckets, kept.new_allocations, 0)
    lease = pool.acquire(10, ms.float16)      # what was cached is still served
    assert pool.stats().new_allocations == kept.new_allocations + (before == "empty pool")
    lease.release()


def test_stalls_add_up_their_count_and_time():
    """Two acquires at the in-flight bound each wait ~50 ms for a fence: 2 stalls, and at least
    the 100 ms slept (a lower bound only: nothing here can make a sleep shorter)."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_buckets_in_flight=1)
    pool.acquire(8, ms.float32).release(_SlowHandle(0.05))
    lease = pool.acquire(8, ms.float32)
    lease.release(_SlowHandle(0.05))
    pool.acquire(8, ms.float32).release()
    stats = pool.stats()
    assert stats.stalls == 2
    assert stats.stall_seconds >= 0.1


def test_a_fence_that_fails_while_the_pool_waits_is_quarantined_and_logged(caplog):
    """The wait counts as a stall; the bucket is not reused (a new one is allocated), and the
    log line names its size, dtype and the error."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_buckets_in_flight=1)
    pool.acquire(8, ms.bfloat16).release(_SlowHandle(0, RuntimeError("link down")))
    with caplog.at_level("WARNING", logger="gradpool.pool"):
        lease = pool.acquire(8, ms.bfloat16)
    assert [r.getMessage() for r in caplog.records] == [
        f"a 16-byte {ms.bfloat16} bucket is quarantined (never reused; trim() frees it after a "
        "device synchronize): its fence wait() raised RuntimeError: link down"]
    stats = pool.stats()
    assert (stats.stalls, stats.reuses, stats.new_allocations) == (1, 0, 2)
    assert (stats.quarantined_buckets, stats.quarantined_bytes, stats.failed_fences) == (1, 16, 1)
    lease.release()


def test_a_fence_whose_is_completed_raises_is_quarantined_and_logged(caplog):
    class Broken:
        def wait(self):
            pass

        def is_completed(self):
            raise RuntimeError("handle lost")

        def __repr__(self):
            return "Broken()"
    pool = BucketPool(device="CPU", alignment_bytes=4)
    with caplog.at_level("WARNING", logger="gradpool.pool"):
        pool.acquire(8, ms.float32).release(Broken())
    assert [r.getMessage() for r in caplog.records] == [
        f"a 32-byte {ms.float32} bucket is quarantined (never reused; trim() frees it after a "
        "device synchronize): its fence is_completed() raised RuntimeError: handle lost"]
    stats = pool.stats()
    assert (stats.free_buckets, stats.quarantined_buckets, stats.failed_fences) == (0, 1, 1)
    assert pool.trim() == 32 and pool.stats().quarantined_buckets == 0


def test_a_fresh_pool_and_lease_state():
    """Copies are timed unless asked not to; nothing reserved means a high-water of 0; a lease
    of a bucket's exact capacity is the allocation itself (no view op), and not released."""
    pool = BucketPool(device="CPU", alignment_bytes=4)
    assert pool.timed_copies is True and BucketPool(timed_copies=False).timed_copies is False
    assert pool.stats().high_water_bytes == 0
    exact = pool.acquire(8, ms.float32)
    assert exact.tensor is exact.allocation and exact.released is False
    exact.release()
    part = pool.acquire(6, ms.float32)           # served by the 8-element bucket
    assert part.tensor is not part.allocation and part.tensor.shape == (6,)
    part.release()


def test_releasing_something_that_is_no_lease_names_its_type():
    pool = BucketPool(device="CPU")
    with pytest.raises(ForeignLeaseError) as err:
        pool.release("lease")
    assert str(err.value) == "release() takes a Lease from this pool, got str 'lease'"


def test_an_unfenced_or_completed_release_frees_at_once_and_keeps_no_fence():
    """Seen from another thread (which never reaps), a bucket released with no fence or a
    completed one is free right away; and the pool keeps no reference to a completed fence (a
    zero-copy fence holds the caller's gradient)."""
    import gc
    import weakref
    from gradpool.comm import CompletedHandle
    pool = BucketPool(device="CPU", alignment_bytes=4)
    pool.acquire(8, ms.float32).release()
    fence = CompletedHandle()
    alive = weakref.ref(fence)
    pool.acquire(4, ms.float16).release(fence)
    del fence
    gc.collect()
    assert alive() is None
    seen = []
    worker = threading.Thread(target=lambda: seen.append(pool.stats()))
    worker.start()
    worker.join()
    assert (seen[0].free_buckets, seen[0].fenced_buckets) == (2, 0)


def test_a_bucket_as_large_as_the_device_memory_is_allowed_one_byte_more_is_not(monkeypatch):
    monkeypatch.setattr(pool_module, "device_memory_bytes", lambda device: 400)
    pool = BucketPool(device="CPU", alignment_bytes=4)
    pool.acquire(100, ms.float32).release()
    with pytest.raises(PoolCapacityError) as err:
        pool.acquire(101, ms.float32)
    assert str(err.value).startswith("a bucket of 101 x Float32 (404 bytes) cannot fit the CPU "
                                     "device's 400 bytes of memory")


def test_the_limit_is_the_pool_device_s_memory():
    from gradpool.device import ASCEND_910B_HBM_BYTES
    numel = ASCEND_910B_HBM_BYTES // 4 + 1
    with pytest.raises(PoolCapacityError) as err:
        BucketPool(device="Ascend").acquire(numel, ms.float32)
    assert f"cannot fit the Ascend device's {ASCEND_910B_HBM_BYTES} bytes" in str(err.value)


def test_a_dtype_equal_to_the_bucket_s_but_another_object_reuses_it():
    import copy
    pool = BucketPool(device="CPU", alignment_bytes=4)
    pool.acquire(8, ms.float32).release()
    twin = copy.deepcopy(ms.float32)
    assert twin == ms.float32 and twin is not ms.float32
    pool.acquire(8, twin).release()
    assert (pool.stats().reuses, pool.stats().new_allocations) == (1, 1)


def test_under_the_cap_an_in_flight_bucket_of_exactly_the_size_asked_is_waited_for():
    """64 bytes in flight under a 100-byte cap; 16 more float32 (64 bytes) would pass the cap,
    and the in-flight bucket holds exactly 16: the acquire waits for it and takes it."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=100)
    first = pool.acquire(16, ms.float32)
    allocation = first.allocation
    first.release(_SlowHandle(0))
    lease = pool.acquire(16, ms.float32)
    assert lease.allocation is allocation
    stats = pool.stats()
    assert (stats.new_allocations, stats.stalls, stats.reuses) == (1, 1, 1)
    lease.release()
