"""Which free bucket a request reuses: the one rule the pool follows and the memory plan replays.

Pure Python. The rule: of the free buckets of the request's dtype that hold its elements, the
smallest (large buckets stay for large gradients); of equal capacity, the first allocated (so the
choice depends on the pool's history alone, and the plan's replay picks the very bucket).
:func:`choose` scans a pool's records (the pool keeps no index beside them: a bucket's state is
one attribute, changed by stores an interrupt cannot split); :class:`FreeIndex` keeps the free
buckets sorted for the memory plan's replay of a 671B model (tens of thousands of free buckets,
hundreds of thousands of requests: docs/benchmarks/host-path.md#bucket-reuse).
``tests/test_reuse.py`` checks both against a brute-force reference.
"""
from __future__ import annotations

import bisect
from typing import Any, Iterable, Optional

FREE = "free"    # the state of a record a request may reuse


def choose(buckets: Iterable[Any], numel: int, dtype) -> Optional[Any]:
    """The record of ``buckets`` (with ``state``, ``capacity`` in elements and ``dtype``, in
    allocation order) a request for ``numel`` x ``dtype`` reuses, or None. Only :data:`FREE`
    records are candidates: the pool passes all, since listing the free ones on every acquire
    would cost more than the scan (docs/benchmarks/host-path.md#bucket-reuse)."""
    best = None
    for b in buckets:
        # identity first: a MindSpore dtype's == is a pybind call, and this runs per bucket
        if b.state == FREE and b.capacity >= numel \
                and (best is None or b.capacity < best.capacity) \
                and (b.dtype is dtype or b.dtype == dtype):
            best = b
    return best


class FreeIndex:
    """Free buckets kept in :func:`choose`'s order: per dtype (a hashable key), sorted by
    (capacity, allocation order), so :meth:`take` is a binary search. ``order`` is the record's
    allocation position (any increasing integers)."""

    def __init__(self):
        self._sorted: dict = {}       # dtype -> sorted [(capacity, order)]
        self._records: dict = {}      # order -> record

    def add(self, record, order: int) -> None:
        """``record`` (with ``capacity`` and ``dtype``) is free from now on."""
        bisect.insort(self._sorted.setdefault(record.dtype, []), (record.capacity, order))
        self._records[order] = record

    def take(self, numel: int, dtype) -> Optional[Any]:
        """Remove and return the record :func:`choose` would pick among those added, or None."""
        free = self._sorted.get(dtype)
        if not free:
            return None
        at = bisect.bisect_left(free, (numel,))   # the first whose capacity holds numel
        if at == len(free):
            return None
        return self._records.pop(free.pop(at)[1])
