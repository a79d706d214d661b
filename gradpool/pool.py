"""BucketPool: pre-allocated flat buckets per (dtype, device), leased and recycled after a fence.

Ownership rule (the reason this module exists): storage is released only by
:func:`_release_storage`, which takes a ``_Bucket`` record, and only :meth:`BucketPool._allocate`
makes one, so the pool can never free a tensor it did not allocate. Recycling frees nothing;
:meth:`BucketPool.trim`, and ``acquire`` evicting under ``max_cached_bytes``, release only idle
buckets (no live lease, no pending fence).

Lifetime: ``acquire`` -> ``Lease`` -> ``lease.release(fence)`` -> *fenced* until the fence
completes (:meth:`Lease.release`) -> poisoned with NaN if asked -> *free*. A fence whose
``wait()`` or ``is_completed()`` raises never completes: its bucket is *quarantined* (the device
may still be writing it), never leased again, and freed by :meth:`BucketPool.trim` only after a
device-wide synchronize. ``acquire`` reuses the
free bucket :func:`gradpool.reuse.choose` picks; with none large enough it allocates, unless that
would pass ``max_cached_bytes``: then it waits for a fenced bucket that fits, else evicts idle
buckets, else raises :class:`PoolCapacityError` (leaving the pool as it was).

Robustness: a bucket's state is one attribute and every count is derived from the records, so
the pool never reports bytes it does not hold; every state change is a plain store after the last
call that can raise (``KeyboardInterrupt`` included), or is rolled back. A re-entrant lock lets
threads share a pool, but its own tensor writes (poison, freeing) run only on the thread that
created it: MindSpore aborts when two threads launch ops at once.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Optional, Protocol

import mindspore as ms
from mindspore import mint

from gradpool.device import (SUPPORTED_DEVICES, device_memory_bytes, on_real_device,
                             real_device_target, synchronize)
from gradpool.dtypes import check_dtype, is_supported_singleton, itemsize, nan_fill, writable_view
from gradpool.errors import (ForeignLeaseError, InvalidArgumentError, InvalidFenceError,
                             LeaseStateError, PoolCapacityError, check_bool, check_int)
from gradpool.layout import round_up
from gradpool.reuse import FREE, choose

logger = logging.getLogger(__name__)

_pool_ids = itertools.count(1)
MAX_ALIGNMENT_BYTES = 2 ** 20    # chunk alignment beyond 1 MiB would be padding, not alignment
_FREE, _FENCED, _LEASED = FREE, "fenced", "leased"     # FREE: the state gradpool.reuse reuses
_QUARANTINED = "quarantined"     # its fence failed: never leased again, freed after a synchronize
_CHECKED_REQUESTS = 4096     # distinct requests remembered by _checked_capacity


class Fence(Protocol):
    """Anything that says when a collective reading a bucket is done (a comm handle)."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


class _WaitOnlyFence:
    """A handle with ``wait()`` but no ``is_completed()`` (MindSpore 2.10's ``CommHandle``): it
    counts as in flight until someone has waited on it through this wrapper, never guessed done."""

    def __init__(self, handle):
        self._handle = handle
        self._waited = False

    def wait(self) -> Any:
        try:
            return self._handle.wait()
        finally:
            self._waited = True     # a wait that raised is over all the same

    def is_completed(self) -> bool:
        return self._waited

    def __repr__(self) -> str:
        return f"_WaitOnlyFence({self._handle!r}, waited={self._waited})"


def as_fence(handle) -> Optional[Fence]:
    """``handle`` as a fence: itself when it has ``wait()`` and ``is_completed()``, wrapped when it
    has ``wait()`` only (done once waited through the wrapper), None for None; anything else is
    refused with :class:`InvalidFenceError`."""
    if handle is None or isinstance(handle, _WaitOnlyFence):
        return handle
    if not callable(getattr(handle, "wait", None)):
        raise InvalidFenceError(
            f"a fence needs a wait() method (and ideally is_completed()); got "
            f"{type(handle).__name__} {handle!r}. Pass the collective's handle, or None")
    if callable(getattr(handle, "is_completed", None)):
        return handle
    return _WaitOnlyFence(handle)


def fence_done(fence: Fence) -> bool:
    """``fence.is_completed()`` as a bool. A fence whose ``is_completed()`` raises is not
    completed: the error propagates (the pool quarantines the bucket behind such a fence)."""
    return bool(fence.is_completed())


@dataclass
class PoolStats:
    """A snapshot of the pool's counters (``BucketPool.stats()`` returns a copy)."""

    new_allocations: int = 0
    reuses: int = 0
    bytes_reserved: int = 0
    high_water_bytes: int = 0
    live_leases: int = 0
    fenced_buckets: int = 0
    free_buckets: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0
    stall_seconds: float = 0.0
    stalls: int = 0
    padding_bytes: int = 0
    trimmed_bytes: int = 0
    quarantined_buckets: int = 0    # held now: their fence failed, the device may still write
    quarantined_bytes: int = 0
    failed_fences: int = 0          # fences that raised, since the pool was made

    @property
    def copy_gbps(self) -> float:
        return self.bytes_copied / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0


@dataclass(eq=False, slots=True)
class _Bucket:
    """Pool-internal record of one allocation. Never handed out; leases refer to it."""

    tensor: ms.Tensor         # the whole allocation, flat, created by the pool
    dtype: Any
    capacity: int             # elements
    state: str = _FREE
    fence: Optional[Fence] = None
    fenced_order: int = 0     # FIFO position among fenced buckets (waits go oldest first)
    lease: Optional["Lease"] = None
    failure: Optional[str] = None     # why it is quarantined: what its fence raised

    @property
    def nbytes(self) -> int:
        return self.capacity * itemsize(self.dtype)


def _release_storage(bucket: _Bucket) -> None:
    """The only place gradpool releases storage; it takes a pool record, never a caller tensor."""
    bucket.tensor.untyped_storage().resize_(0)


class Lease:
    """A live claim on one bucket; ``.tensor`` is a flat view of exactly ``numel`` elements."""

    __slots__ = ("_pool", "_bucket", "numel", "dtype", "_tensor", "_released", "__weakref__")

    def __init__(self, pool: "BucketPool", bucket: _Bucket, numel: int):
        self._pool = pool
        self._bucket = bucket
        self.numel = numel
        self.dtype = bucket.dtype
        self._tensor = bucket.tensor if numel == bucket.capacity else bucket.tensor[0:numel]
        self._released = False

    @property
    def pool(self) -> "BucketPool":
        return self._pool

    @property
    def released(self) -> bool:
        return self._released

    @property
    def tensor(self) -> ms.Tensor:
        if self._released:
            raise LeaseStateError(
                f"lease of {self.numel} x {self.dtype} was released; its bucket may already hold "
                "another gradient. Read .tensor before release(), or acquire a new lease")
        return self._tensor

    @property
    def allocation(self) -> ms.Tensor:
        """The whole flat allocation ``.tensor`` is a prefix of, for the bucket writers
        (:mod:`gradpool.writers`); only ``[0, numel)`` belongs to this lease."""
        if self._released:
            self.tensor  # noqa: B018 - raises LeaseStateError
        return self._bucket.tensor

    @property
    def is_whole_bucket(self) -> bool:
        """True when ``.tensor`` is the entire allocation (whole-tensor ``copy_`` is valid)."""
        return self.numel == self._bucket.capacity

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def release(self, fence: Optional[Fence] = None) -> None:
        """Give the bucket back, leased again only once ``fence`` (the collective's handle, or
        None: at once) has completed: ``is_completed()`` true, or waited on by the pool. A fence
        whose ``is_completed()`` or ``wait()`` raises quarantines the bucket (never leased again).
        With ``wait()`` only (MindSpore 2.10's ``CommHandle``) it is in flight until waited on
        through the pool (``acquire`` at the in-flight bound, ``wait_all()``) or the reducer's
        result. Anything else: :class:`InvalidFenceError`, and the lease stays live."""
        self._pool.release(self, fence)

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"Lease({self.numel} x {self.dtype}, {state})"


class BucketPool:
    """A pool of flat communication buckets owned by gradpool. ``alignment_bytes``: bucket sizes
    are rounded up to this many bytes (512 is Ascend's rule). ``max_cached_bytes``: cap on bytes
    held at once (None: no cap). ``max_buckets_in_flight``: cap on buckets per dtype whose
    collective may still run; at the cap ``acquire`` first waits for the oldest fence.
    ``poison_on_release``: fill a bucket with NaN when its fence completes, before any reuse.
    ``timed_copies``: synchronize after each pack so ``copy_seconds`` is the real copy time (off
    on Ascend, to keep packing and communication overlapped)."""

    def __init__(self, device: Optional[str] = None, alignment_bytes: int = 512,
                 max_cached_bytes: Optional[int] = None, poison_on_release: bool = False,
                 max_buckets_in_flight: Optional[int] = None, timed_copies: bool = True):
        check_int("alignment_bytes", alignment_bytes, 4, MAX_ALIGNMENT_BYTES)
        if alignment_bytes % 4:
            raise InvalidArgumentError(
                f"alignment_bytes must be a multiple of 4, got {alignment_bytes!r}")
        check_int("max_cached_bytes", max_cached_bytes, 1, nullable=True)
        check_int("max_buckets_in_flight", max_buckets_in_flight, 1, nullable=True)
        check_bool("poison_on_release", poison_on_release)
        check_bool("timed_copies", timed_copies)
        # under ms.DeviceCtx("meta") (a model built without memory) buckets still need memory
        self.device = device if device is not None else real_device_target()
        if self.device not in SUPPORTED_DEVICES:
            raise InvalidArgumentError(
                f"device {self.device!r} is not supported; use one of {SUPPORTED_DEVICES}")
        self.alignment_bytes = alignment_bytes
        self.max_cached_bytes = max_cached_bytes
        self.max_buckets_in_flight = max_buckets_in_flight
        self.poison_on_release = poison_on_release
        self.timed_copies = timed_copies
        self.pool_id = next(_pool_ids)
        self._buckets: list[_Bucket] = []
        self._fence_order = itertools.count()
        self._adopted: list[_Bucket] = []     # what the current acquire allocated
        self._high_water = 0
        self._stats = PoolStats()       # counters only; sizes are derived from _buckets
        self._checked: dict = {}        # (numel, id(dtype), cap) -> capacity, see _checked_capacity
        self._lock = threading.RLock()
        # tensor writes stay on this thread (module docstring); others' stats() or trim() only count
        self._owner = threading.get_ident()

    # -- public API -------------------------------------------------------------------------
    def alignment_elements(self, dtype) -> int:
        return max(1, self.alignment_bytes // itemsize(dtype))

    def reserve(self, dtype, numel: int, count: int = 1) -> None:
        """Pre-allocate ``count`` idle buckets of ``numel`` elements (rounded up to alignment)."""
        check_int("count", count, 1)
        self._check_request(numel, dtype)
        capacity = self._capacity_for(numel, dtype)
        with self._lock:
            needed = capacity * itemsize(dtype) * count
            self._check_cap(needed, f"reserve of {count} x {capacity * itemsize(dtype)} bytes")
            made = [self._allocate(capacity, dtype) for _ in range(count)]
            self._adopt(made)

    def acquire(self, numel: int, dtype, *, holder: Optional[list] = None) -> Lease:
        """Lease a bucket of at least ``numel`` elements of ``dtype`` (``.tensor`` has numel).
        ``holder``: a list the acquire itself appends the lease to, so a ``KeyboardInterrupt`` as
        it returns cannot lose a live lease (``lease = acquire(...)`` has that window)."""
        # A remembered request costs one lookup (see _checked_capacity); True hashes as 1.
        capacity = self._checked.get((numel, id(dtype), self.max_cached_bytes)) \
            if type(numel) is int else None
        if capacity is None:
            capacity = self._checked_capacity(numel, dtype)
        with self._lock:
            self._reap()
            bound = self.max_buckets_in_flight
            while bound is not None and len(self._in(_FENCED, dtype)) >= bound:
                self._wait_for(self._oldest_fenced(dtype))
            self._adopted = ()          # what this acquire allocates (see _adopt)
            try:
                bucket = choose(self._buckets, numel, dtype)      # gradpool.reuse's rule
                if bucket is None:
                    bucket = self._grow(numel, dtype, capacity)   # may wait for one in flight
                reused = bucket not in self._adopted       # identity: _Bucket has eq=False
                lease = Lease(self, bucket, numel)
            except BaseException:
                self._forget_adopted()
                raise
            # commit: the holder first (an interrupt right after it is undone by release, which
            # sees an uncommitted lease), then plain stores, between which nothing can raise
            if holder is not None:
                holder.append(lease)
            bucket.lease = lease
            bucket.state = _LEASED
            if reused:
                self._stats.reuses += 1
            return lease

    def release(self, lease: Lease, fence: Optional[Fence] = None) -> None:
        """See :meth:`Lease.release`."""
        if not isinstance(lease, Lease):
            raise ForeignLeaseError(
                f"release() takes a Lease from this pool, got {type(lease).__name__} {lease!r}")
        if lease._pool is not self:
            raise ForeignLeaseError(
                f"{lease!r} was issued by pool {lease.pool.pool_id}, not by this pool "
                f"({self.pool_id}); release it through the pool that issued it")
        if fence is not None:
            fence = as_fence(fence)
        with self._lock:
            if lease._released:
                raise LeaseStateError(f"{lease!r} was already released; a lease is released once")
            bucket = lease._bucket
            if bucket.lease is not lease:
                lease._released = True      # its acquire was interrupted before it committed
                return
            failure = None
            try:
                done = fence is None or fence_done(fence)
            except Exception as exc:  # noqa: BLE001 - a broken handle: quarantined below
                done, failure = False, exc
            if done and self.poison_on_release:
                self._poison(bucket)
            order = next(self._fence_order)
            # commit
            lease._released = True
            bucket.lease = None
            bucket.fence = None if done else fence
            bucket.fenced_order = order
            if failure is not None:
                self._quarantine(bucket, "is_completed()", failure)
            else:
                bucket.state = _FREE if done else _FENCED

    def trim(self) -> int:
        """Release the storage of idle buckets, and of quarantined ones once a device-wide
        synchronize has proved them idle; the bytes freed (0 off the pool's thread)."""
        if threading.get_ident() != self._owner:
            return 0
        with self._lock:
            self._reap()
            freed = sum(self._drop(bucket) for bucket in self._in(_FREE))
            freed += self._free_quarantined()
        if freed:
            logger.debug("trimmed %d bytes", freed)
        return freed

    def wait_all(self) -> None:
        """Wait for every pending fence and recycle its bucket (only real waits count as stalls);
        a fence whose wait raises quarantines its bucket (the error is its collective's owner's
        to raise, through the result it waits on)."""
        with self._lock:
            self._reap()
            for bucket in sorted(self._in(_FENCED), key=lambda b: b.fenced_order):
                self._wait_for(bucket)

    def stats(self) -> PoolStats:
        """A consistent snapshot (reaps completed fences first)."""
        with self._lock:
            self._reap()
            reserved = sum(b.nbytes for b in self._buckets)
            quarantined = self._in(_QUARANTINED)
            return replace(self._stats, bytes_reserved=reserved,
                           high_water_bytes=max(self._high_water, reserved),
                           live_leases=len(self._in(_LEASED)),
                           fenced_buckets=len(self._in(_FENCED)),
                           free_buckets=len(self._in(_FREE)),
                           quarantined_buckets=len(quarantined),
                           quarantined_bytes=sum(b.nbytes for b in quarantined))

    def record_copy(self, nbytes: int, seconds: float, padding_bytes: int) -> None:
        """Account ``nbytes`` written into this pool's buckets (the reducer calls it per pack)."""
        with self._lock:
            self._stats.bytes_copied += nbytes
            self._stats.copy_seconds += seconds
            self._stats.padding_bytes += padding_bytes

    # -- internals ----------------------------------------------------------------------------
    def _check_request(self, numel, dtype) -> None:
        check_int("numel", numel, 1)
        check_dtype(dtype)
        nbytes = self._capacity_for(numel, dtype) * itemsize(dtype)
        limit = device_memory_bytes(self.device)
        if nbytes > limit:
            raise PoolCapacityError(
                f"a bucket of {numel} x {dtype} ({nbytes} bytes) cannot fit the {self.device} "
                f"device's {limit} bytes of memory; reduce in smaller buckets")
        if self.max_cached_bytes is not None and nbytes > self.max_cached_bytes:
            raise PoolCapacityError(
                f"a bucket of {numel} x {dtype} ({nbytes} bytes) exceeds "
                f"max_cached_bytes={self.max_cached_bytes}; raise the cap or use smaller buckets")

    def _checked_capacity(self, numel, dtype) -> int:
        """The capacity for ``numel`` x ``dtype`` after :meth:`_check_request`, remembered for an
        int ``numel`` of a supported dtype singleton (immortal, so its id() is never reused): the
        reducer repeats requests every step (docs/benchmarks/host-path.md#remembered-requests)."""
        self._check_request(numel, dtype)
        capacity = self._capacity_for(numel, dtype)
        if type(numel) is int and is_supported_singleton(dtype):
            if len(self._checked) >= _CHECKED_REQUESTS:
                self._checked.clear()
            self._checked[(numel, id(dtype), self.max_cached_bytes)] = capacity
        return capacity

    def _check_cap(self, new_bytes: int, what: str) -> None:
        cap = self.max_cached_bytes
        reserved = sum(b.nbytes for b in self._buckets)
        if cap is not None and reserved + new_bytes > cap:
            raise PoolCapacityError(
                f"{what} would exceed max_cached_bytes={cap}: the pool already caches "
                f"{reserved} bytes. Raise max_cached_bytes, release leases, or trim()")

    def _capacity_for(self, numel: int, dtype) -> int:
        return round_up(numel, self.alignment_elements(dtype))

    def _in(self, state: str, dtype=None) -> list[_Bucket]:
        # identity first: a MindSpore dtype's == is a pybind call, and this runs per bucket
        return [b for b in self._buckets if b.state == state
                and (dtype is None or b.dtype is dtype or b.dtype == dtype)]

    def _oldest_fenced(self, dtype) -> _Bucket:
        return min(self._in(_FENCED, dtype), key=lambda b: b.fenced_order)

    def _allocate(self, capacity: int, dtype) -> _Bucket:
        """A new, untracked bucket record, its allocation forced now (a failure shows here)."""
        with on_real_device():
            tensor = mint.empty(capacity, dtype=dtype)
        try:
            tensor.untyped_storage().data_ptr()      # MindSpore allocates lazily: force it
        except RuntimeError as exc:
            raise PoolCapacityError(
                f"allocating a bucket of {capacity} x {dtype} failed on {self.device}: {exc}; "
                "reduce bucket_cap_mib or free memory") from None
        return _Bucket(tensor=tensor, dtype=dtype, capacity=capacity)

    def _adopt(self, buckets: list[_Bucket]) -> None:
        """Track newly allocated buckets (one list extend: all or none)."""
        self._adopted = buckets         # first, so an interrupted acquire can undo the extend
        self._buckets.extend(buckets)
        self._stats.new_allocations += len(buckets)
        self._high_water = max(self._high_water, sum(b.nbytes for b in self._buckets))

    def _forget_adopted(self) -> None:
        """Undo what an interrupted acquire allocated: its new buckets that are still idle."""
        fresh = [b for b in self._adopted if b.state == _FREE and any(b is t for t in self._buckets)]
        if fresh:
            self._buckets = [b for b in self._buckets if all(b is not f for f in fresh)]
            self._stats.new_allocations -= len(fresh)

    def _grow(self, numel: int, dtype, capacity: int) -> _Bucket:
        nbytes = capacity * itemsize(dtype)
        what = f"acquire of {numel * itemsize(dtype)} bytes (bucket {nbytes} bytes)"
        cap = self.max_cached_bytes
        if cap is not None and sum(b.nbytes for b in self._buckets) + nbytes > cap:
            fits = [b for b in self._in(_FENCED, dtype) if b.capacity >= numel]
            if fits:
                bucket = min(fits, key=lambda b: b.capacity)
                if self._wait_for(bucket):
                    return bucket
                return self._grow(numel, dtype, capacity)   # it failed: quarantined, try again
            idle = sum(b.nbytes for b in self._in(_FREE))
            # Refuse before evicting anything, so a refused acquire leaves the pool as it was.
            self._check_cap(nbytes - idle, what)
            self._evict_idle(nbytes)
        self._check_cap(nbytes, what)
        bucket = self._allocate(capacity, dtype)
        self._adopt([bucket])
        return bucket

    def _evict_idle(self, needed: int) -> None:
        """Free idle buckets (smallest first, any dtype) until ``needed`` more bytes fit the cap."""
        for bucket in sorted(self._in(_FREE), key=lambda b: b.nbytes):
            if sum(b.nbytes for b in self._buckets) + needed <= self.max_cached_bytes:
                return
            self._drop(bucket)

    def _drop(self, bucket: _Bucket) -> int:
        """Stop tracking an idle bucket, then release its storage; the bytes freed."""
        self._buckets = [b for b in self._buckets if b is not bucket]
        self._stats.trimmed_bytes += bucket.nbytes
        _release_storage(bucket)
        return bucket.nbytes

    def _wait_for(self, bucket: _Bucket) -> bool:
        """Block on ``bucket``'s fence (a stall), then recycle it: True. A fence whose wait()
        raised quarantines the bucket: False (the collective's owner raises the error when it
        waits for its result; a failed collective may still be writing, so no reuse)."""
        start = time.perf_counter()
        try:
            bucket.fence.wait()
            failure = None
        except Exception as exc:  # noqa: BLE001 - quarantined below
            failure = exc
        finally:
            self._stats.stall_seconds += time.perf_counter() - start
            self._stats.stalls += 1
        if failure is not None:
            self._quarantine(bucket, "wait()", failure)
            return False
        self._recycle(bucket)
        return True

    def _reap(self) -> None:
        if threading.get_ident() != self._owner:
            return          # recycled by the owner thread (its next acquire, stats or wait)
        for bucket in self._buckets:        # no list built: this runs on every acquire
            if bucket.state != _FENCED:
                continue
            try:
                done = fence_done(bucket.fence)
            except Exception as exc:  # noqa: BLE001 - quarantined, not recycled
                self._quarantine(bucket, "is_completed()", exc)
                continue
            if done:
                self._recycle(bucket)

    def _quarantine(self, bucket: _Bucket, call: str, exc: BaseException) -> None:
        """``bucket``'s fence raised in ``call``: the collective behind it failed, and the device
        may still write into the bucket. It keeps its fence (and what the fence holds alive), is
        never leased again, and is freed only by :meth:`_free_quarantined`."""
        bucket.failure = f"{call} raised {type(exc).__name__}: {exc}"
        bucket.state = _QUARANTINED
        self._stats.failed_fences += 1
        logger.warning("a %d-byte %s bucket is quarantined (never reused; trim() frees it after "
                       "a device synchronize): its fence %s", bucket.nbytes, bucket.dtype,
                       bucket.failure)

    def _free_quarantined(self) -> int:
        """Free every quarantined bucket after a device-wide synchronize has shown nothing still
        runs that could write into it (a synchronize that raises frees nothing); the bytes."""
        quarantined = self._in(_QUARANTINED)
        if not quarantined:
            return 0
        synchronize()
        for bucket in quarantined:
            bucket.fence = None
        return sum(self._drop(bucket) for bucket in quarantined)

    def _recycle(self, bucket: _Bucket) -> None:
        self._poison(bucket)
        bucket.fence = None
        bucket.state = _FREE

    def _poison(self, bucket: _Bucket) -> None:
        if self.poison_on_release:
            writable_view(bucket.tensor)[:] = nan_fill(bucket.dtype)
