"""BucketPool: pre-allocated flat buckets per (dtype, device), leased and recycled after a fence.

Ownership rule (the reason this module exists): storage is only ever released by
:func:`_release_storage`, which takes a ``_Bucket`` record. A ``_Bucket`` is created only by
:meth:`BucketPool._allocate`, so the pool can never free a tensor it did not allocate, whatever a
caller passes in. Recycling never frees anything. Storage is released by :meth:`BucketPool.trim`
and, under a ``max_cached_bytes`` cap, by ``acquire`` evicting idle buckets to make room; both
only touch idle buckets with no live lease and no pending fence.

Lifetimes:

* ``acquire`` -> ``Lease`` (live) -> ``lease.release(fence)`` -> bucket *fenced* until
  ``fence.is_completed()`` -> (poisoned with NaN if asked) -> *free*, acquirable again.
* ``max_buckets_in_flight`` bounds the buckets per dtype whose collective may still be running
  (fenced): an ``acquire`` that finds that many waits for the oldest fence first (a stall).
* With no free bucket large enough, ``acquire`` allocates, unless that would pass
  ``max_cached_bytes``: then it waits for a fenced bucket that fits, else evicts idle buckets,
  else raises :class:`PoolCapacityError` (leaving the pool as it was).
* A fence whose ``is_completed()`` or ``wait()`` raises is over as far as memory goes: the bucket
  is recycled and the error is left to whoever waits on that handle for its result.
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Optional, Protocol

import mindspore as ms
from mindspore import mint

from gradpool.device import SUPPORTED_DEVICES, device_target
from gradpool.dtypes import check_dtype, itemsize, nan_fill, writable_view
from gradpool.errors import (ForeignLeaseError, InvalidArgumentError, LeaseStateError,
                             PoolCapacityError)
from gradpool.layout import round_up

logger = logging.getLogger(__name__)

_pool_ids = itertools.count(1)


class Fence(Protocol):
    """Anything that says when a collective reading a bucket is done (a comm handle)."""

    def wait(self) -> Any: ...

    def is_completed(self) -> bool: ...


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

    @property
    def copy_gbps(self) -> float:
        return self.bytes_copied / self.copy_seconds / 1e9 if self.copy_seconds > 0 else 0.0


@dataclass(eq=False)
class _Bucket:
    """Pool-internal record of one allocation. Never handed out; leases refer to it."""

    tensor: ms.Tensor         # the whole allocation, flat, created by the pool
    dtype: Any
    capacity: int             # elements
    fence: Optional[Fence] = None

    @property
    def nbytes(self) -> int:
        return self.capacity * itemsize(self.dtype)


def fence_done(fence: Fence) -> bool:
    try:
        return fence.is_completed()
    except Exception as exc:  # noqa: BLE001 - a broken handle reads nothing any more
        logger.warning("fence %r raised in is_completed(), treated as completed: %s", fence, exc)
        return True


def _release_storage(bucket: _Bucket) -> None:
    """The only place gradpool releases storage; it takes a pool record, never a caller tensor."""
    bucket.tensor.untyped_storage().resize_(0)


class Lease:
    """A live claim on one bucket; ``.tensor`` is a flat view of exactly ``numel`` elements."""

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
        """The whole flat allocation ``.tensor`` is the prefix of. For writers that address host
        memory directly (``gradpool.pack``); only ``[0, numel)`` belongs to this lease."""
        self.tensor  # noqa: B018 - raises on a released lease
        return self._bucket.tensor

    @property
    def is_whole_bucket(self) -> bool:
        """True when ``.tensor`` is the entire allocation (whole-tensor ``copy_`` is valid)."""
        return self.numel == self._bucket.capacity

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def release(self, fence: Optional[Fence] = None) -> None:
        """Give the bucket back; it is reused only after ``fence`` (None: already done) completes."""
        self._pool.release(self, fence)

    def __repr__(self) -> str:
        state = "released" if self._released else "live"
        return f"Lease({self.numel} x {self.dtype}, {state})"


@dataclass
class _FreeLists:
    free: list = field(default_factory=list)     # idle buckets, no fence
    fenced: list = field(default_factory=list)   # released, waiting for their fence (FIFO)


class BucketPool:
    """A pool of flat communication buckets owned by gradpool.

    ``alignment_bytes``: bucket sizes are rounded up to this many bytes (512 is Ascend's rule).
    ``max_cached_bytes``: cap on bytes the pool holds at once (None: no cap).
    ``max_buckets_in_flight``: cap on buckets per dtype whose collective may still be running;
    at the cap ``acquire`` first waits for the oldest fence.
    ``poison_on_release``: fill a bucket with NaN when its fence completes, before any reuse.
    ``timed_copies``: synchronize the device after each pack so ``copy_seconds`` is the real
    copy time (turn off on Ascend to keep packing and communication overlapped).
    """

    def __init__(self, device: Optional[str] = None, alignment_bytes: int = 512,
                 max_cached_bytes: Optional[int] = None, poison_on_release: bool = False,
                 max_buckets_in_flight: Optional[int] = None, timed_copies: bool = True):
        if not isinstance(alignment_bytes, int) or alignment_bytes < 2 or alignment_bytes % 4:
            raise InvalidArgumentError(
                f"alignment_bytes must be a positive multiple of 4, got {alignment_bytes!r}")
        if max_cached_bytes is not None and max_cached_bytes <= 0:
            raise InvalidArgumentError(
                f"max_cached_bytes must be positive or None, got {max_cached_bytes!r}")
        if max_buckets_in_flight is not None and max_buckets_in_flight < 1:
            raise InvalidArgumentError(
                f"max_buckets_in_flight must be >= 1 or None, got {max_buckets_in_flight!r}")
        # None: the process's device target. Copies take the NumPy host path only on "CPU".
        self.device = device if device is not None else device_target()
        if self.device not in SUPPORTED_DEVICES:
            raise InvalidArgumentError(
                f"device {self.device!r} is not supported; use one of {SUPPORTED_DEVICES}")
        self.alignment_bytes = alignment_bytes
        self.max_cached_bytes = max_cached_bytes
        self.max_buckets_in_flight = max_buckets_in_flight
        self.poison_on_release = poison_on_release
        self.timed_copies = timed_copies
        self.pool_id = next(_pool_ids)
        self._lists: dict[tuple, _FreeLists] = {}
        self._live: set[Lease] = set()
        self._stats = PoolStats()

    # -- public API -------------------------------------------------------------------------
    def alignment_elements(self, dtype) -> int:
        return max(1, self.alignment_bytes // itemsize(dtype))

    def reserve(self, dtype, numel: int, count: int = 1) -> None:
        """Pre-allocate ``count`` idle buckets of ``numel`` elements (rounded up to alignment)."""
        self._check_request(numel, dtype)
        if not isinstance(count, int) or count < 1:
            raise InvalidArgumentError(f"count must be an int >= 1, got {count!r}")
        capacity = self._capacity_for(numel, dtype)
        needed = capacity * itemsize(dtype) * count
        self._check_cap(needed, f"reserve of {count} x {capacity * itemsize(dtype)} bytes")
        for _ in range(count):
            self._lists_for(dtype).free.append(self._allocate(capacity, dtype))

    def acquire(self, numel: int, dtype) -> Lease:
        """Lease a bucket of at least ``numel`` elements of ``dtype``; ``.tensor`` has exactly numel."""
        self._check_request(numel, dtype)
        lists = self._lists_for(dtype)
        self._reap(lists)
        cap = self.max_buckets_in_flight
        while cap is not None and len(lists.fenced) >= cap:
            self._wait_for(lists, lists.fenced[0])
        bucket = self._take_free(lists, numel)
        if bucket is None:
            bucket = self._grow(lists, numel, dtype)
        else:
            self._stats.reuses += 1
        lease = Lease(self, bucket, numel)
        self._live.add(lease)
        return lease

    def release(self, lease: Lease, fence: Optional[Fence] = None) -> None:
        if not isinstance(lease, Lease):
            raise ForeignLeaseError(
                f"release() takes a Lease from this pool, got {type(lease).__name__} {lease!r}")
        if lease.pool is not self:
            raise ForeignLeaseError(
                f"{lease!r} was issued by pool {lease.pool.pool_id}, not by this pool "
                f"({self.pool_id}); release it through the pool that issued it")
        if lease.released:
            raise LeaseStateError(f"{lease!r} was already released; a lease is released once")
        lease._released = True
        self._live.discard(lease)
        bucket = lease._bucket
        bucket.fence = fence
        lists = self._lists_for(bucket.dtype)
        if fence is None or fence_done(fence):
            self._recycle(lists, bucket)
        else:
            lists.fenced.append(bucket)

    def trim(self) -> int:
        """Release the storage of idle buckets (no lease, fence completed). Returns bytes freed."""
        freed = 0
        for lists in self._lists.values():
            self._reap(lists)
            for bucket in lists.free:
                _release_storage(bucket)
                freed += bucket.nbytes
            lists.free.clear()
        self._stats.bytes_reserved -= freed
        self._stats.trimmed_bytes += freed
        if freed:
            logger.debug("trimmed %d bytes", freed)
        return freed

    def wait_all(self) -> None:
        """Wait for every pending fence, then recycle those buckets."""
        for lists in self._lists.values():
            while lists.fenced:
                self._wait_for(lists, lists.fenced[0])

    def stats(self) -> PoolStats:
        for lists in self._lists.values():
            self._reap(lists)
        return replace(self._stats,
                       live_leases=len(self._live),
                       fenced_buckets=sum(len(l.fenced) for l in self._lists.values()),
                       free_buckets=sum(len(l.free) for l in self._lists.values()))

    def record_copy(self, nbytes: int, seconds: float, padding_bytes: int) -> None:
        """Account ``nbytes`` written into this pool's buckets (the reducer calls it per pack)."""
        self._stats.bytes_copied += nbytes
        self._stats.copy_seconds += seconds
        self._stats.padding_bytes += padding_bytes

    # -- internals ----------------------------------------------------------------------------
    def _check_request(self, numel, dtype) -> None:
        if not isinstance(numel, int) or isinstance(numel, bool) or numel <= 0:
            raise InvalidArgumentError(f"numel must be a positive int, got {numel!r}")
        check_dtype(dtype)

    def _check_cap(self, new_bytes: int, what: str) -> None:
        cap = self.max_cached_bytes
        if cap is not None and self._stats.bytes_reserved + new_bytes > cap:
            raise PoolCapacityError(
                f"{what} would exceed "
                f"max_cached_bytes={cap}: the pool already caches {self._stats.bytes_reserved} "
                "bytes. Raise max_cached_bytes, release leases, or trim()")

    def _capacity_for(self, numel: int, dtype) -> int:
        return round_up(numel, self.alignment_elements(dtype))

    def _lists_for(self, dtype) -> _FreeLists:
        return self._lists.setdefault((dtype, self.device), _FreeLists())

    def _allocate(self, capacity: int, dtype) -> _Bucket:
        tensor = mint.empty(capacity, dtype=dtype)
        bucket = _Bucket(tensor=tensor, dtype=dtype, capacity=capacity)
        self._stats.new_allocations += 1
        self._stats.bytes_reserved += bucket.nbytes
        self._stats.high_water_bytes = max(self._stats.high_water_bytes, self._stats.bytes_reserved)
        return bucket

    @staticmethod
    def _take_free(lists: _FreeLists, numel: int) -> Optional[_Bucket]:
        fits = [b for b in lists.free if b.capacity >= numel]
        if not fits:
            return None
        best = min(fits, key=lambda b: b.capacity)
        lists.free.remove(best)
        return best

    def _grow(self, lists: _FreeLists, numel: int, dtype) -> _Bucket:
        capacity = self._capacity_for(numel, dtype)
        nbytes = capacity * itemsize(dtype)
        what = f"acquire of {numel * itemsize(dtype)} bytes (bucket {nbytes} bytes)"
        cap = self.max_cached_bytes
        if cap is not None and self._stats.bytes_reserved + nbytes > cap:
            fits = [b for b in lists.fenced if b.capacity >= numel]
            if fits:
                # Growing would pass the cap: wait for the smallest in-flight bucket that fits.
                self._wait_for(lists, min(fits, key=lambda b: b.capacity))
                self._stats.reuses += 1
                return self._take_free(lists, numel)
            idle = sum(b.nbytes for l in self._lists.values() for b in l.free)
            # Refuse before evicting anything, so a refused acquire leaves the pool as it was.
            self._check_cap(nbytes - idle, what)
            self._evict_idle(nbytes)
        self._check_cap(nbytes, what)
        return self._allocate(capacity, dtype)

    def _evict_idle(self, needed: int) -> None:
        """Free idle buckets (smallest first, any dtype) until ``needed`` more bytes fit the cap."""
        idle = sorted((b for l in self._lists.values() for b in l.free), key=lambda b: b.nbytes)
        for bucket in idle:
            if self._stats.bytes_reserved + needed <= self.max_cached_bytes:
                return
            self._lists_for(bucket.dtype).free.remove(bucket)
            _release_storage(bucket)
            self._stats.bytes_reserved -= bucket.nbytes
            self._stats.trimmed_bytes += bucket.nbytes

    def _wait_for(self, lists: _FreeLists, bucket: _Bucket) -> None:
        """Block on ``bucket``'s fence (a stall), then recycle it."""
        lists.fenced.remove(bucket)
        start = time.perf_counter()
        try:
            bucket.fence.wait()
        except Exception as exc:  # noqa: BLE001
            # A fence whose wait() raised is over all the same: the bucket is reusable, and the
            # error belongs to whoever waits on that handle for its result, not to this acquire.
            logger.warning("fence of a %s bucket failed while the pool waited on it: %s",
                           bucket.dtype, exc)
        self._stats.stall_seconds += time.perf_counter() - start
        self._stats.stalls += 1
        self._recycle(lists, bucket)

    def _reap(self, lists: _FreeLists) -> None:
        done = [b for b in lists.fenced if fence_done(b.fence)]
        for bucket in done:
            lists.fenced.remove(bucket)
            self._recycle(lists, bucket)

    def _recycle(self, lists: _FreeLists, bucket: _Bucket) -> None:
        bucket.fence = None
        if self.poison_on_release:
            writable_view(bucket.tensor)[:] = nan_fill(bucket.dtype)
        lists.free.append(bucket)
