"""BucketPool: leases, reuse, fences, trim, poison, ownership, and typed errors for bad input."""
import ast
import pathlib

import mindspore as ms
import numpy as np
import pytest

from gradpool import writers
from gradpool.errors import (ForeignLeaseError, InvalidArgumentError, LeaseStateError,
                             PoolCapacityError, UnsupportedDtypeError)
from gradpool.layout import ReduceScatterLayout
from gradpool.pool import BucketPool
from npref import raw_bytes, storage_bytes, values

ms.set_device("CPU")
ROOT = pathlib.Path(__file__).resolve().parents[1]


class ManualFence:
    """A fence the test completes by hand; wait() completes it and counts the call."""

    def __init__(self):
        self.done = False
        self.waits = 0

    def is_completed(self):
        return self.done

    def wait(self):
        self.waits += 1
        self.done = True


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


def test_failed_fence_still_recycles_the_bucket():
    class FailingFence(ManualFence):
        def wait(self):
            self.done = True
            raise RuntimeError("collective failed")

    pool = BucketPool(max_buckets_in_flight=1)
    pool.acquire(64, ms.float32).release(FailingFence())
    lease = pool.acquire(64, ms.float32)
    assert pool.stats().new_allocations == 1
    lease.release()


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


@pytest.mark.parametrize("when", ["at release", "while fenced"])
def test_a_fence_that_raises_is_treated_as_completed(when):
    pool = BucketPool()
    first = pool.acquire(64, ms.float32)
    ptr = first.tensor.untyped_storage().data_ptr()
    fence = BreakableFence()
    fence.broken = when == "at release"
    first.release(fence)
    fence.broken = True
    second = pool.acquire(64, ms.float32)        # recycled, not lost nor listed twice
    assert second.tensor.untyped_storage().data_ptr() == ptr
    s = pool.stats()
    assert (s.new_allocations, s.fenced_buckets, s.free_buckets, s.live_leases) == (1, 0, 0, 1)
    second.release()


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
