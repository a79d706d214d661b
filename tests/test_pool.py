"""BucketPool: leases, reuse, fences, trim, poison, ownership, and typed errors for bad input
(exact messages, and the pool's table of the bad-input matrix). And the pool under what a
demanding user does: fences with wait() only, Ctrl-C inside acquire and release, a monitoring
thread while the main thread reduces, sizes beyond the device or the cache cap; after each the
pool holds exactly the bytes it says and no lease is live that nobody holds."""
import ast
import copy
import pathlib
import random
import threading
import time

import mindspore as ms
import numpy as np
import pytest

from gradpool import pool as pool_module
from gradpool import writers
from gradpool.comm import SingleProcessCommunicator
from gradpool.device import device_memory_bytes
from gradpool.errors import (ArgumentTypeError, CollectiveError, ForeignLeaseError, GradPoolError,
                             InvalidArgumentError, InvalidFenceError, LeaseStateError,
                             PoolCapacityError, UnsupportedDtypeError)
from gradpool.layout import ReduceScatterLayout
from gradpool.pool import BucketPool, as_fence
from gradpool.reducer import GradReducer, ReducerConfig
from gradpool.testing import FaultInjectingCommunicator
from bad_inputs import POOL_CASES, assert_refused_typed
from npref import raw_bytes, storage_bytes, values
from pool_checks import (Interrupt, QuarantineWatch, assert_consistent, assert_reduces_correctly,
                         step_grads)
from simulated import ManualFence, WaitOnlyHandle

ms.set_device("CPU")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_acquire_gives_flat_tensor_of_exact_numel():
    pool = BucketPool()
    for dtype in (ms.float32, ms.float16, ms.bfloat16):
        lease = pool.acquire(1000, dtype)
        assert lease.tensor.shape == (1000,) and lease.tensor.dtype == dtype
        lease.release()


def test_release_then_acquire_reuses_the_bucket():
    pool = BucketPool()
    first = pool.acquire(300, ms.float32)
    ptr = first.tensor.untyped_storage().data_ptr()
    first.release()
    second = pool.acquire(200, ms.float32)   # smaller fits the same bucket
    assert second.tensor.untyped_storage().data_ptr() == ptr
    assert second.tensor.shape == (200,)
    s = pool.stats()
    assert (s.new_allocations, s.reuses, s.live_leases) == (1, 1, 1)


def test_repeated_pattern_allocates_only_in_first_cycle():
    pool = BucketPool()
    sizes = [(4096, ms.float32), (1000, ms.bfloat16), (77, ms.float16)]
    for _ in range(20):
        leases = [pool.acquire(n, d) for n, d in sizes]
        for lease in leases:
            lease.release()
    s = pool.stats()
    assert s.new_allocations == 3 and s.reuses == 57
    assert s.high_water_bytes == s.bytes_reserved == (4096 * 4 + 1024 * 2 + 256 * 2)


def test_reserve_preallocates():
    pool = BucketPool()
    pool.reserve(ms.float32, 1024, count=2)
    a, b = pool.acquire(1024, ms.float32), pool.acquire(1000, ms.float32)
    s = pool.stats()
    assert s.new_allocations == 2 and s.reuses == 2
    a.release(), b.release()


def test_fenced_bucket_is_not_reused_until_fence_completes():
    pool = BucketPool()
    lease = pool.acquire(256, ms.float32)
    ptr = lease.tensor.untyped_storage().data_ptr()
    fence = ManualFence()
    lease.release(fence)
    assert pool.stats().fenced_buckets == 1
    other = pool.acquire(256, ms.float32)
    assert other.tensor.untyped_storage().data_ptr() != ptr
    other.release()
    fence.done = True
    again = pool.acquire(256, ms.float32)
    assert pool.stats().fenced_buckets == 0
    assert pool.stats().new_allocations == 2
    again.release()


def test_bucket_cap_in_flight_waits_and_counts_the_stall():
    pool = BucketPool(max_buckets_in_flight=1)
    lease = pool.acquire(256, ms.float32)
    fence = ManualFence()
    lease.release(fence)
    second = pool.acquire(256, ms.float32)
    assert fence.waits == 1
    s = pool.stats()
    assert s.new_allocations == 1 and s.stalls == 1 and s.stall_seconds >= 0
    second.release()


def test_trim_frees_only_idle_buckets():
    pool = BucketPool()
    idle = pool.acquire(1024, ms.float32)
    idle_tensor = idle.tensor
    idle.release()
    live = pool.acquire(2048, ms.float32)
    fenced = pool.acquire(4096, ms.float32)
    fenced_tensor = fenced.tensor
    fenced.release(ManualFence())
    freed = pool.trim()
    assert freed == 1024 * 4
    assert storage_bytes(idle_tensor) == 0
    assert storage_bytes(live.tensor) == 2048 * 4
    assert storage_bytes(fenced_tensor) == 4096 * 4
    assert pool.stats().bytes_reserved == (2048 + 4096) * 4
    live.release()


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16, ms.bfloat16])
def test_poison_fills_released_bucket_with_nan(dtype):
    pool = BucketPool(poison_on_release=True)
    lease = pool.acquire(100, dtype)
    view = lease.tensor
    layout = ReduceScatterLayout.build([(100,)], 1)
    writers.pack(lease, [ms.Tensor(np.ones(100, np.float32))], layout, host=True)
    fence = ManualFence()
    lease.release(fence)
    assert np.all(values(view) == 1), "poisoning before the fence completes corrupts a collective"
    fence.done = True
    pool.stats()   # reaps completed fences
    assert np.isnan(values(view)).all()


def test_pool_never_frees_or_changes_caller_tensors():
    """release() and trim() leave every caller tensor intact, including ones the pool copied."""
    pool = BucketPool(poison_on_release=True)
    rng = np.random.default_rng(1)
    grads = [ms.Tensor(rng.standard_normal(s).astype(np.float32)) for s in [(7, 3), (16,)]]
    bystander = ms.Tensor(rng.standard_normal(64).astype(np.float32))
    before = [(raw_bytes(t), storage_bytes(t)) for t in grads + [bystander]]
    layout = ReduceScatterLayout.build([g.shape for g in grads], 2, 16)
    for dtype in (ms.float32, ms.bfloat16):
        lease = pool.acquire(layout.total_numel, dtype)
        writers.pack(lease, grads, layout, host=True)
        lease.release()
    pool.trim()
    assert [(raw_bytes(t), storage_bytes(t)) for t in grads + [bystander]] == before


# The only functions of the code base that resize storage, and the record type each takes:
# the pool's buckets and the gathered (full) parameters fully_shard frees after forward.
STORAGE_RESIZERS = {("pool.py", "_release_storage"): ("_Bucket", "BucketPool._allocate"),
                    ("gathered.py", "_resize_storage"): ("_Allocation", "GatheredParam.__init__")}


def _resize_calls() -> list:
    calls = []
    for path in list((ROOT / "gradpool").rglob("*.py")) + list((ROOT / "hyper_parallel").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Attribute) and node.attr == "resize_":
                        calls.append((path.name, fn.name, [a.annotation for a in fn.args.args]))
    return calls


def _constructions(path, record: str) -> list:
    """``(enclosing Class.function, ...)`` of every call ``record(...)`` in ``path``."""
    found = []
    tree = ast.parse(path.read_text())
    for cls in [n for n in tree.body if isinstance(n, ast.ClassDef)] + [tree]:
        for fn in (cls.body if isinstance(cls, ast.ClassDef) else cls.body):
            if isinstance(fn, ast.FunctionDef):
                for node in ast.walk(fn):
                    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == record:
                        owner = f"{cls.name}." if isinstance(cls, ast.ClassDef) else ""
                        found.append(f"{owner}{fn.name}")
    return found


def test_storage_is_resized_only_through_a_record_gradpool_made():
    """Structural ownership: each resize_ call takes a record type, and each record type is
    made in one place, around a tensor that place allocated. No other resize_ exists."""
    calls = _resize_calls()
    assert sorted((name, fn) for name, fn, _ in calls) == sorted(STORAGE_RESIZERS), calls
    for name, fn_name, annotations in calls:
        record, maker = STORAGE_RESIZERS[(name, fn_name)]
        assert ast.unparse(annotations[0]) == record, (name, fn_name)
        assert _constructions(ROOT / "gradpool" / name, record) == [maker], \
            f"{record} must be created in exactly one place ({maker})"


# -- bad input: typed error naming the value, stats unchanged ---------------------------------
def _other_pool_lease():
    return BucketPool().acquire(8, ms.float32)


def _released_lease(pool):
    lease = pool.acquire(8, ms.float32)
    lease.release()
    return lease


BAD_CALLS = {
    "zero numel": (lambda p: p.acquire(0, ms.float32), InvalidArgumentError, "got 0"),
    "negative numel": (lambda p: p.acquire(-5, ms.float32), InvalidArgumentError, "got -5"),
    "reserve zero": (lambda p: p.reserve(ms.float32, 0), InvalidArgumentError, "got 0"),
    "int dtype": (lambda p: p.acquire(8, ms.int32), UnsupportedDtypeError, "Float32, Float16, BFloat16"),
    "float64": (lambda p: p.acquire(8, ms.float64), UnsupportedDtypeError, "Float64"),
    "double release": (lambda p: p._double.release(), LeaseStateError, "already released"),
    "foreign release": (lambda p: p.release(p._foreign), ForeignLeaseError, "not by this pool"),
    "tensor after release": (lambda p: p._double.tensor, LeaseStateError, "was released"),
    "over cap": (lambda p: p.acquire(2048, ms.float32), PoolCapacityError, "8192 bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_CALLS))
def test_bad_input_raises_typed_error_and_leaves_stats(case):
    call, error, needle = BAD_CALLS[case]
    pool = BucketPool(max_cached_bytes=4096)
    pool._foreign = _other_pool_lease()
    pool._double = _released_lease(pool)
    before = pool.stats()
    with pytest.raises(error) as err:
        call(pool)
    assert needle in str(err.value)
    assert pool.stats() == before


def test_over_cap_message_gives_requested_and_cached_bytes():
    pool = BucketPool(max_cached_bytes=4096)
    held = pool.acquire(512, ms.float32)     # 2048 bytes cached
    with pytest.raises(PoolCapacityError) as err:
        pool.acquire(1000, ms.float32)
    msg = str(err.value)
    assert "4000 bytes" in msg and "caches 2048 bytes" in msg and "max_cached_bytes=4096" in msg
    held.release()


def test_cap_evicts_idle_buckets_before_refusing():
    pool = BucketPool(max_cached_bytes=4096)
    pool.acquire(512, ms.float16).release()       # 1024 idle bytes
    lease = pool.acquire(1000, ms.float32)        # 4096 bytes: fits only after eviction
    s = pool.stats()
    assert s.bytes_reserved == 4096 and s.trimmed_bytes == 1024
    lease.release()


@pytest.mark.parametrize("kwargs", [dict(alignment_bytes=3), dict(max_cached_bytes=0),
                                    dict(max_buckets_in_flight=0), dict(device="GPU")])
def test_bad_pool_options(kwargs):
    with pytest.raises(InvalidArgumentError) as err:
        BucketPool(**kwargs)
    assert str(list(kwargs.values())[0]) in str(err.value)


def test_pool_device_defaults_to_the_device_target():
    assert BucketPool().device == "CPU"


class BreakableFence(ManualFence):
    """A handle whose is_completed() starts raising once ``broken`` (a failed communicator)."""

    broken = False

    def is_completed(self):
        if self.broken:
            raise RuntimeError("handle is broken")
        return super().is_completed()


class FailingWaitFence(ManualFence):
    """A collective whose wait() raises (it failed; the device may still be writing)."""

    def wait(self):
        self.waits += 1
        raise RuntimeError("link down")


def _quarantine(pool, when):
    """One 64-element float32 bucket whose fence fails ``when``; its lease released."""
    lease = pool.acquire(64, ms.float32)
    if when in ("is_completed at release", "is_completed while fenced"):
        fence = BreakableFence()
        fence.broken = when == "is_completed at release"
        lease.release(fence)
        fence.broken = True
    else:
        lease.release(FailingWaitFence())
        if when == "wait at the in-flight bound":
            pool.acquire(16, ms.float32).release()      # the bound (1) waits the oldest fence
        elif when == "wait in wait_all":
            pool.wait_all()
        else:   # under the cache cap: the acquire waits for the fenced bucket that fits; it
            # fails, and the cap (which the quarantined bucket still counts in) refuses
            with pytest.raises(PoolCapacityError, match="already caches 256 bytes"):
                pool.acquire(64, ms.float32)
    return lease


@pytest.mark.parametrize("when", ["is_completed at release", "is_completed while fenced",
                                  "wait at the in-flight bound", "wait in wait_all",
                                  "wait under the cache cap"])
def test_a_bucket_whose_fence_raised_is_quarantined_until_a_synchronize(when, monkeypatch):
    """Never leased again, never freed by trim() off the pool's thread nor by eviction, counted
    in stats; freed by trim() only after a device-wide synchronize, which finds it still held."""
    capped = when == "wait under the cache cap"
    pool = BucketPool(alignment_bytes=4, max_cached_bytes=384 if capped else None,
                      max_buckets_in_flight=1 if when == "wait at the in-flight bound" else None)
    watch = QuarantineWatch(pool)
    lease = _quarantine(pool, when)
    bad = lease._bucket
    stats = pool.stats()
    assert (stats.quarantined_buckets, stats.quarantined_bytes, stats.failed_fences,
            stats.fenced_buckets) == (1, 256, 1, 0), stats
    assert bad.state == "quarantined" and watch.check() == 1
    others = [pool.acquire(16, ms.float32)] if capped else [pool.acquire(64, ms.float32),
                                                           pool.acquire(16, ms.float32)]
    assert all(o._bucket is not bad for o in others), "a quarantined bucket was leased again"
    for other in others:
        other.release()
    freed = []
    worker = threading.Thread(target=lambda: freed.append(pool.trim()))
    worker.start()
    worker.join()
    assert freed == [0] and watch.check() == 1        # off the pool's thread: nothing freed
    synced = []
    monkeypatch.setattr(pool_module, "synchronize",
                        lambda: synced.append(bad.tensor.untyped_storage().size()))
    pool.trim()
    assert synced == [256], "freed without a synchronize, or before it"
    assert bad.tensor.untyped_storage().size() == 0 and all(b is not bad for b in pool._buckets)
    stats = pool.stats()
    assert (stats.quarantined_buckets, stats.quarantined_bytes, stats.failed_fences) == (0, 0, 1)
    assert_consistent(pool, held=0)
    watch.check()


def test_a_quarantined_bucket_is_not_evicted_under_the_cache_cap():
    """Eviction frees idle buckets only: a quarantined one counts against the cap and stays."""
    pool = BucketPool(alignment_bytes=4, max_cached_bytes=1024)
    _quarantine(pool, "is_completed at release")             # 256 bytes held
    pool.acquire(64, ms.float32).release()                   # 256 bytes idle
    big = pool.acquire(192, ms.float32)        # 768 bytes: fits once the idle bucket is evicted
    stats = pool.stats()
    assert (stats.quarantined_buckets, stats.bytes_reserved, stats.trimmed_bytes) == (1, 1024, 256)
    with pytest.raises(PoolCapacityError, match="already caches 1024 bytes"):
        pool.acquire(64, ms.float32)           # fits only by freeing the quarantined bucket
    big.release()
    stats = pool.stats()
    assert (stats.quarantined_buckets, stats.trimmed_bytes) == (1, 256)


def test_in_flight_bound_ignores_live_leases_and_waits_only_at_the_bound():
    pool = BucketPool(max_buckets_in_flight=2)
    held = [pool.acquire(64, ms.float32) for _ in range(3)]   # live (e.g. outputs): no bound
    fences = [ManualFence(), ManualFence()]
    extra = [pool.acquire(128, ms.float32) for _ in range(2)]
    extra[0].release(fences[0])
    assert pool.stats().stalls == 0
    pool.acquire(16, ms.float32).release()                   # one fenced: below the bound
    assert pool.stats().stalls == 0 and fences[0].waits == 0
    extra[1].release(fences[1])                              # two fenced: at the bound
    pool.acquire(16, ms.float32).release()
    s = pool.stats()
    assert s.stalls == 1 and fences[0].waits == 1 and fences[1].waits == 0
    assert s.fenced_buckets == 1
    for lease in held:
        lease.release()


def test_wait_all_counts_only_real_waits_as_stalls():
    class Fence:
        def __init__(self, done):
            self.done, self.waits = done, 0

        def is_completed(self):
            return self.done

        def wait(self):
            self.waits += 1
            self.done = True

    pool = BucketPool(device="CPU", alignment_bytes=4)
    done, pending = Fence(False), Fence(False)
    pool.acquire(8, ms.float32).release(done)
    pool.acquire(8, ms.float32).release(pending)
    done.done = True                      # completed since its release, never waited
    pool.wait_all()
    stats = pool.stats()
    assert (done.waits, pending.waits, stats.stalls, stats.fenced_buckets) == (0, 1, 1, 0)


# -- checked requests, exact messages, ownership --------------------------------------------------
def test_acquire_remembers_only_requests_of_the_dtype_singletons():
    """acquire remembers a checked request by the dtype's id(): only a singleton's id is that
    dtype's for the life of the process. A twin (equal, another object) is checked on every
    acquire and never remembered: once it is freed, a dtype object that is not supported may get
    its id."""
    pool = BucketPool(device="CPU", alignment_bytes=4)
    checks = []
    check_request = pool._check_request
    pool._check_request = lambda numel, dtype: checks.append(numel) or check_request(numel,
                                                                                      dtype)
    twin = copy.deepcopy(ms.float32)
    pool.acquire(16, twin).release()
    assert pool._checked == {}
    pool.acquire(16, ms.float32).release()
    assert pool._checked == {(16, id(ms.float32), None): 16}
    lease = pool.acquire(16, ms.float32)        # remembered: not checked again
    assert lease.tensor.shape == (16,) and checks == [16, 16]
    lease.release()
    with pytest.raises(UnsupportedDtypeError):
        pool.acquire(16, copy.deepcopy(ms.int32))
    assert pool._checked == {(16, id(ms.float32), None): 16}


def test_second_release_names_the_released_lease():
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(8, ms.float32)
    assert repr(lease) == "Lease(8 x Float32, live)"
    lease.release()
    with pytest.raises(LeaseStateError) as err:
        lease.release()
    assert str(err.value) == ("Lease(8 x Float32, released) was already released; a lease is "
                              "released once")


def test_a_lease_released_into_another_pool_is_refused_naming_both_pools():
    issuer, other = BucketPool(device="CPU", alignment_bytes=4), BucketPool(device="CPU",
                                                                          alignment_bytes=4)
    assert isinstance(issuer.pool_id, int) and issuer.pool_id != other.pool_id
    lease = issuer.acquire(8, ms.float32)
    with pytest.raises(ForeignLeaseError) as err:
        other.release(lease)
    assert str(err.value) == (f"Lease(8 x Float32, live) was issued by pool {issuer.pool_id}, "
                              f"not by this pool ({other.pool_id}); release it through the pool "
                              "that issued it")
    assert not lease.released
    lease.release()


def test_reserve_count_error_names_the_argument():
    pool = BucketPool(device="CPU", alignment_bytes=4)
    with pytest.raises(InvalidArgumentError) as err:
        pool.reserve(ms.float32, 16, count=0)
    assert str(err.value) == "count must be an int >= 1, got 0"
    assert pool.stats().bytes_reserved == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(alignment_bytes=2 ** 21),
     "alignment_bytes must be an int >= 4 and <= 1048576, got 2097152"),
    (dict(alignment_bytes=2), "alignment_bytes must be an int >= 4 and <= 1048576, got 2"),
    (dict(alignment_bytes=6), "alignment_bytes must be a multiple of 4, got 6"),
    (dict(max_cached_bytes=0), "max_cached_bytes must be an int >= 1, got 0"),
    (dict(max_cached_bytes=1.5), "max_cached_bytes must be an int or None, got float 1.5"),
    (dict(max_buckets_in_flight=0), "max_buckets_in_flight must be an int >= 1, got 0"),
    (dict(poison_on_release=1), "poison_on_release must be a bool (True or False), got int 1"),
    (dict(timed_copies=None),
     "timed_copies must be a bool (True or False), got NoneType None"),
    (dict(device="GPU"), "device 'GPU' is not supported; use one of ('CPU', 'Ascend')"),
])
def test_pool_arguments_are_refused_naming_the_argument(kwargs, message):
    with pytest.raises(GradPoolError) as err:
        BucketPool(**kwargs)
    assert str(err.value) == message


def test_requests_no_bucket_can_serve_are_refused_naming_the_size():
    pool = BucketPool(device="CPU", alignment_bytes=4)
    with pytest.raises(InvalidArgumentError) as err:
        pool.acquire(0, ms.float32)
    assert str(err.value) == "numel must be an int >= 1, got 0"
    limit = device_memory_bytes("CPU")
    numel = limit // 4 + 1
    with pytest.raises(PoolCapacityError) as err:
        pool.acquire(numel, ms.float32)
    assert str(err.value) == (f"a bucket of {numel} x Float32 ({numel * 4} bytes) cannot fit the "
                              f"CPU device's {limit} bytes of memory; reduce in smaller buckets")
    assert pool.stats().new_allocations == 0


def test_a_bucket_over_the_cache_cap_is_refused_with_its_size_in_bytes():
    """The cap compares bytes: 17 float32 elements are 68 bytes, over a 64-byte cap (in elements
    they would fit)."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=64)
    with pytest.raises(PoolCapacityError) as err:
        pool.acquire(17, ms.float32)
    assert str(err.value) == ("a bucket of 17 x Float32 (68 bytes) exceeds max_cached_bytes=64; "
                              "raise the cap or use smaller buckets")
    pool.acquire(16, ms.float32).release()         # 64 bytes: at the cap is allowed
    assert pool.stats().bytes_reserved == 64


def test_an_allocation_the_device_refuses_is_a_capacity_error_naming_the_fix(monkeypatch):
    """MindSpore allocates lazily; the pool forces the allocation, and a refusal (a RuntimeError
    there, injected here) is a PoolCapacityError that says what to do, the pool unchanged."""

    class Refused:
        def untyped_storage(self):
            return self

        def data_ptr(self):
            raise RuntimeError("out of memory")

    monkeypatch.setattr(pool_module.mint, "empty", lambda *args, **kwargs: Refused())
    pool = pool_module.BucketPool(device="CPU", alignment_bytes=4)
    with pytest.raises(PoolCapacityError) as err:
        pool.acquire(16, ms.float32)
    assert str(err.value) == ("allocating a bucket of 16 x Float32 failed on CPU: out of memory; "
                              "reduce bucket_cap_mib or free memory")
    stats = pool.stats()
    assert (stats.new_allocations, stats.bytes_reserved, stats.live_leases) == (0, 0, 0)


def test_an_accepted_request_does_not_let_a_bad_one_through():
    """acquire remembers the requests it checked; a bool equal to a remembered numel (True == 1),
    an equal-but-rejected dtype and a lowered cap must still be refused."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=4096)
    pool.acquire(1, ms.float32).release()
    pool.acquire(1024, ms.float32).release()
    with pytest.raises(ArgumentTypeError, match="True"):
        pool.acquire(True, ms.float32)
    with pytest.raises(UnsupportedDtypeError, match="Int32"):
        pool.acquire(1, ms.int32)
    pool.max_cached_bytes = 1024
    with pytest.raises(PoolCapacityError, match="max_cached_bytes=1024"):
        pool.acquire(1024, ms.float32)


# -- an interrupted acquire -----------------------------------------------------------------------
class _InterruptedHolder(list):
    """A holder that takes the lease, then is interrupted (a KeyboardInterrupt arriving in the
    acquire's commit, after the holder has the lease and before the pool recorded it)."""

    def append(self, item):
        super().append(item)
        raise KeyboardInterrupt


def test_lease_of_an_interrupted_acquire_is_released_once_and_unreadable():
    """Releasing the lease an interrupted acquire left in its holder marks it released (reads
    refuse it, a second release raises) and leaves the bucket free for the next acquire."""
    pool = BucketPool(device="CPU", alignment_bytes=4)
    holder = _InterruptedHolder()
    with pytest.raises(KeyboardInterrupt):
        pool.acquire(8, ms.float32, holder=holder)
    lease, = holder
    lease.release()
    assert lease.released is True
    with pytest.raises(LeaseStateError):
        lease.tensor  # noqa: B018
    with pytest.raises(LeaseStateError):
        lease.release()
    again = pool.acquire(8, ms.float32)
    assert pool.stats().new_allocations == 1 and again.is_whole_bucket
    again.release()


# -- fences: wait() only, in flight under the bound and the cap, eviction -------------------------
def test_a_wait_only_handle_reports_false_until_waited():
    class WaitOnly:
        def wait(self):
            return "done"

    fence = as_fence(WaitOnly())
    assert fence.is_completed() is False
    assert fence.wait() == "done"
    assert fence.is_completed() is True


def test_a_handle_without_wait_is_refused_as_a_fence_naming_it():
    class NoWait:
        def __repr__(self):
            return "NoWait()"

    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(8, ms.float32)
    with pytest.raises(InvalidFenceError) as err:
        lease.release(NoWait())
    assert str(err.value) == ("a fence needs a wait() method (and ideally is_completed()); got "
                              "NoWait NoWait(). Pass the collective's handle, or None")
    assert not lease.released
    lease.release()


def test_in_flight_bound_waits_only_on_the_same_dtype():
    """At the in-flight bound an acquire waits for the oldest fence of its own dtype (the stall
    timed within the acquire); an older fence of another dtype is left in flight."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_buckets_in_flight=1)
    other, same = ManualFence(), ManualFence()
    pool.acquire(8, ms.bfloat16).release(other)          # the older fence, another dtype
    pool.acquire(8, ms.float32).release(same)
    start = time.perf_counter()
    lease = pool.acquire(8, ms.float32)
    elapsed = time.perf_counter() - start
    assert (same.done, other.done) == (True, False)
    stats = pool.stats()
    assert (stats.stalls, stats.fenced_buckets, stats.reuses) == (1, 1, 1)
    assert 0 <= stats.stall_seconds <= elapsed
    lease.release()


@pytest.mark.parametrize("cap, numel, expect", [(100, 8, "wait"), (152, 16, "allocate")])
def test_under_the_cap_an_acquire_waits_for_an_in_flight_bucket_of_its_dtype(cap, numel, expect):
    """In flight: a 64-byte float32 bucket and an older, smaller 24-byte bfloat16 one (88 bytes
    cached). A 32-byte float32 acquire that would pass a 100-byte cap waits for the float32
    bucket and takes it, never the other dtype's; a 64-byte one that exactly reaches a 152-byte
    cap allocates and waits for nothing."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=cap)
    other, same = ManualFence(), ManualFence()
    pool.acquire(12, ms.bfloat16).release(other)
    pool.acquire(16, ms.float32).release(same)
    lease = pool.acquire(numel, ms.float32)
    assert lease.dtype == ms.float32 and other.done is False
    stats = pool.stats()
    if expect == "wait":
        assert same.done
        assert (stats.new_allocations, stats.stalls, stats.fenced_buckets) == (2, 1, 1)
    else:
        assert not same.done and (stats.new_allocations, stats.stalls) == (3, 0)
    lease.release()


def test_over_the_cap_the_smallest_fitting_in_flight_bucket_is_waited_for():
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=160)
    larger, smaller = ManualFence(), ManualFence()
    pool.acquire(24, ms.float32).release(larger)
    pool.acquire(16, ms.float32).release(smaller)
    lease = pool.acquire(8, ms.float32)            # 160 cached + 32 would pass the cap
    assert (smaller.done, larger.done) == (True, False)
    assert lease.numel == 8 and pool.stats().new_allocations == 2
    lease.release()


def test_eviction_under_the_cap_frees_the_smallest_idle_buckets_first():
    """An acquire over the cache cap with no fenced bucket to wait for evicts idle buckets,
    smallest first, only as many as make room: 64 + 128 cached, 160 more under a 320 cap frees
    the 64-byte bucket only."""
    pool = BucketPool(device="CPU", alignment_bytes=4, max_cached_bytes=320)
    small, large = pool.acquire(16, ms.float32), pool.acquire(32, ms.float32)
    small.release()
    large.release()
    pool.acquire(40, ms.float32).release()
    stats = pool.stats()
    assert (stats.trimmed_bytes, stats.bytes_reserved, stats.free_buckets) == (64, 288, 2)


def test_a_wait_only_fence_is_in_flight_until_the_pool_waits_on_it():
    pool = BucketPool(alignment_bytes=4)
    lease = pool.acquire(64, ms.float32)
    ptr = lease.allocation.untyped_storage().data_ptr()
    handle = WaitOnlyHandle()
    lease.release(handle)
    assert pool.stats().fenced_buckets == 1, "never guessed done"
    other = pool.acquire(64, ms.float32)
    assert other.allocation.untyped_storage().data_ptr() != ptr
    other.release()
    pool.wait_all()
    assert handle.waits == 1 and pool.stats().fenced_buckets == 0
    both = [pool.acquire(64, ms.float32), pool.acquire(64, ms.float32)]
    assert ptr in [lease.allocation.untyped_storage().data_ptr() for lease in both]
    assert pool.stats().new_allocations == 2, "the waited bucket is reused, not a third"
    for lease in both:
        lease.release()


def test_a_wait_only_fence_is_waited_at_the_in_flight_bound():
    pool = BucketPool(alignment_bytes=4, max_buckets_in_flight=1)
    first = pool.acquire(64, ms.float32)
    handle = WaitOnlyHandle()
    first.release(handle)
    second = pool.acquire(64, ms.float32)       # at the bound: waits the oldest fence
    assert handle.waits == 1 and pool.stats().stalls == 1
    second.release()


@pytest.mark.parametrize("fence", [object(), 3, "done", lambda: None],
                         ids=["object", "int", "str", "function"])
def test_a_fence_without_wait_is_refused_and_the_lease_stays_live(fence):
    pool = BucketPool(alignment_bytes=4)
    lease = pool.acquire(16, ms.float32)
    before = pool.stats()
    with pytest.raises(InvalidFenceError, match="wait"):
        lease.release(fence)
    assert not lease.released and pool.stats() == before
    lease.release()


# -- Ctrl-C inside acquire and release, a monitoring thread ---------------------------------------
def _uninterrupted_step_seconds() -> float:
    """The median time of the interrupt test's step (fence, acquire, release) here, now."""
    pool = BucketPool(alignment_bytes=4, poison_on_release=True)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        fence = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.001
                                           ).all_reduce(ms.Tensor(np.zeros(1, np.float32)))
        pool.acquire(2048, ms.float32).release(fence)
        times.append(time.perf_counter() - start)
    pool.wait_all()
    return sorted(times)[len(times) // 2]


def test_interrupts_inside_acquire_and_release_of_the_pool_itself():
    rng = random.Random(77)
    pool = BucketPool(alignment_bytes=4, poison_on_release=True, max_buckets_in_flight=2,
                      max_cached_bytes=128 * 1024)
    watch = QuarantineWatch(pool)
    interrupt = Interrupt()
    held = []
    completed = refused = 0
    window = max(0.003, 2 * _uninterrupted_step_seconds())
    try:
        for step in range(400):
            # a fifth of the collectives fail: wait() or is_completed() raises (made before the
            # timer is armed: building a communicator takes longer than most interrupt delays)
            fault = rng.choice([{}, {}, {}, {}, {"fail_wait": True}, {"fail_is_completed": True}])
            fence = FaultInjectingCommunicator(
                SingleProcessCommunicator(), delay_seconds=0.001, **fault).all_reduce(
                ms.Tensor(np.zeros(1, np.float32)))
            # The outer handler catches an interrupt wherever in the step it lands: a refusal
            # leaves the timer armed, and it fired in the PoolCapacityError handler below (a
            # loaded machine's pytest worker died of it).
            try:
                try:
                    # up to twice a step's time on this machine now (at least 3 ms): a fixed
                    # window let no step complete on a loaded machine
                    interrupt.arm(rng.uniform(0.000005, window))
                    # holder=: the lease is in held as part of the acquire. The oldest lease stays
                    # in held until its release commits: an interrupt between taking a lease out of
                    # the list and releasing it would lose it in this loop, not in the pool.
                    pool.acquire(rng.choice([16, 300, 2048, 4000]),
                                 rng.choice([ms.float32, ms.bfloat16]), holder=held)
                    if len(held) > 3:
                        held[0].release(fence)
                    if step % 37 == 0:
                        pool.trim()
                    # Disarmed inside the try: a Ctrl-C landing after the work, before the finally
                    # disarms, would otherwise escape the test (CI saw it end the whole session).
                    interrupt.disarm()
                    completed += 1
                except PoolCapacityError:
                    refused += 1    # the cap, quarantined buckets counted in: refused whole
                finally:
                    interrupt.disarm()
            except KeyboardInterrupt:
                pass
            held = [lease for lease in held if not lease.released]
            assert_consistent(pool, held=len(held))
            watch.check()
            if step % 8 == 7:
                pool.trim()         # quarantined buckets count in the cap until trimmed
    finally:
        interrupt.close()
    for lease in held:
        lease.release()
    pool.wait_all()
    assert_consistent(pool, held=0)
    assert completed > 40 and 400 - completed - refused > 40, (completed, refused)
    assert watch.check() > 10 and pool.stats().failed_fences >= len(watch.seen)


def test_a_monitoring_thread_while_the_main_thread_reduces():
    """The monitor reads stats and trims (which frees nothing off the pool's thread, quarantined
    buckets included) while every ninth step's collective fails: the step gets a CollectiveError,
    the other steps NumPy's values, and no quarantined bucket is leased again."""
    pool = BucketPool(alignment_bytes=4, poison_on_release=True)
    comm = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.0005)
    reducer = GradReducer(pool, comm, ReducerConfig(comm_fusion=True))
    watch = QuarantineWatch(pool)
    failures = []
    errors, snapshots = [], []
    stop = threading.Event()

    def monitor():
        while not stop.is_set():
            try:
                stats = pool.stats()
                assert stats.bytes_reserved <= stats.high_water_bytes
                snapshots.append(stats.live_leases)
                pool.trim()
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                errors.append(exc)
            time.sleep(0.0002)      # a monitor polls; it does not spin on the GIL

    thread = threading.Thread(target=monitor)
    thread.start()
    wrong = nan = 0
    try:
        for step in range(2000):
            arrays, tensors = step_grads(step % 50)
            comm.fail_wait = True if step % 9 == 4 else None
            result = reducer.reduce_scatter(tensors, op="sum")
            try:
                shards = result.wait()
            except CollectiveError as exc:
                failures.append((step, "injected failure" in str(exc)))
                continue
            for shard, want in zip(shards, arrays):
                got = shard.asnumpy()
                nan += int(np.isnan(got).any())
                wrong += int(not np.array_equal(got, want))
            result.release()
            watch.check()
            if step % 200 == 199:
                pool.trim()
    finally:
        stop.set()
        thread.join()
    assert (errors, nan, wrong) == ([], 0, 0)
    assert failures == [(step, True) for step in range(2000) if step % 9 == 4]
    assert len(snapshots) > 100, "the monitor really ran alongside"
    pool.wait_all()
    assert_consistent(pool, held=0)
    assert watch.check() >= len(failures)


def test_pool_lock_costs_little(capsys):
    """Reported, not asserted: acquire+release pairs per second with the lock."""
    pool = BucketPool(alignment_bytes=4)
    pool.acquire(64, ms.float32).release()
    start = time.perf_counter()
    for _ in range(5000):
        pool.acquire(64, ms.float32).release()
    per_pair = (time.perf_counter() - start) / 5000
    with capsys.disabled():
        print(f"\nacquire+release: {per_pair * 1e6:.1f} us per pair (one lock each)")
    assert pool.stats().live_leases == 0


# -- sizes beyond the device and the cache cap ----------------------------------------------------
@pytest.mark.parametrize("numel", [2 ** 62, 2 ** 40, 2 ** 61 + 3])
def test_sizes_beyond_the_device_are_refused_at_acquire(numel):
    pool = BucketPool()
    before = pool.stats()
    with pytest.raises(PoolCapacityError, match=str(numel)):
        pool.acquire(numel, ms.float32)
    assert pool.stats() == before and pool._buckets == []


def test_a_request_larger_than_the_cache_cap_is_refused_naming_it():
    pool = BucketPool(max_cached_bytes=4096)
    with pytest.raises(PoolCapacityError, match="max_cached_bytes=4096") as err:
        pool.acquire(2048, ms.float32)
    assert "2048" in str(err.value) and pool.stats().bytes_reserved == 0


def test_an_allocation_failure_surfaces_at_acquire(monkeypatch):
    """A size the device check lets through but the allocator cannot give (256 GiB here)."""
    monkeypatch.setattr(pool_module, "device_memory_bytes", lambda device: 2 ** 50)
    pool = BucketPool()
    pool.acquire(1024, ms.float32).release()
    before = pool.stats()
    with pytest.raises(PoolCapacityError, match="allocating a bucket"):
        pool.acquire(2 ** 36, ms.float32)
    assert pool.stats() == before
    assert_reduces_correctly(GradReducer(pool, SingleProcessCommunicator()))


# -- the pool's table of the bad-input matrix (tests/bad_inputs.py) -------------------------------
@pytest.mark.parametrize("name", sorted(POOL_CASES))
def test_bad_input_is_refused_typed_naming_the_value(name):
    assert_refused_typed(name)
