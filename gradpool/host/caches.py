"""The machine's CPU caches, and the streaming-store thresholds of the host copies derived from them.

Pure Python (no MindSpore, no numba): :func:`read_caches` reads Linux sysfs, :func:`thresholds_for`
maps cache sizes to thresholds, :func:`stream_thresholds` is the pair for this machine, read once
per process. Why streaming stores have a threshold at all: a copy whose source and destination fit
the last-level cache is as fast with ordinary stores and leaves the bucket in the cache, where the
collective reads it next; a larger one evicts the destination anyway, and an ordinary store that
misses first reads the line it overwrites (3 bytes moved per byte copied instead of 2).
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

logger = logging.getLogger(__name__)

SYSFS_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
# A VM may report its host's whole L3, of which it gets far less, so a share above this per CPU
# sharing the cache is not believed. Few parts have more per core; on those the cap only streams
# buckets that would have fit, at about the same copy speed
# (docs/benchmarks/host-path.md#stream-thresholds-from-the-cache-size).
MAX_CACHE_PER_CPU = 16 << 20
# When no cache size can be read at all: a last-level cache as small as x86 servers and desktops
# ship to a pair of cores. Too small a guess only streams some buckets that would have fit the
# cache (copy speed about equal); too large a guess copies larger buckets at memcpy's 3-byte cost.
FALLBACK_LAST_LEVEL = 8 << 20
CACHE_LINE = 64


@dataclass(frozen=True)
class CacheLevel:
    """One data or unified cache as sysfs describes it (``index*/``): level, bytes, and how many
    CPUs share it (``shared_cpu_list``; 1 when unknown)."""

    level: int
    size_bytes: int
    shared_cpus: int = 1


@dataclass(frozen=True)
class StreamThresholds:
    """From how many bytes written the compiled host writers use non-temporal stores.

    ``copy_from_bytes``: a same-dtype copy of ``n`` bytes holds ``2 n`` bytes in the cache, in a
    cache it never has to itself (the other CPUs sharing it; on a VM, the host's other guests).
    ``cast_from_bytes``: float32 -> bfloat16 writes ``n`` bytes from ``2 n`` read, ``3 n`` in all.
    ``last_level_bytes`` is the cache share they were derived from, ``source`` where it came from
    (``sysfs``, ``sysconf`` or ``fallback``), both for reports."""

    copy_from_bytes: int
    cast_from_bytes: int
    last_level_bytes: int
    source: str


def _parse_cpu_list(text: str) -> int:
    """How many CPUs a sysfs CPU list (``0-3,8,10-11``) names; at least 1."""
    count = 0
    for part in text.strip().split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        count += int(high) - int(low) + 1 if high else 1
    return max(count, 1)


def _size_bytes(text: str) -> int:
    """A sysfs cache size (``32K``, ``1024K``, ``32M``) in bytes."""
    text = text.strip().upper()
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * scale


def read_caches(root: Path = SYSFS_CACHES) -> tuple[CacheLevel, ...]:
    """The data and unified caches of ``root`` (sysfs's ``cpu0/cache``), lowest level first; empty
    when the directory is missing or unreadable (not Linux, a container without sysfs). An entry
    whose files are missing or malformed is skipped, not guessed."""
    caches = []
    try:
        entries = sorted(Path(root).glob("index*"))
    except OSError:
        return ()
    for entry in entries:
        try:
            kind = (entry / "type").read_text().strip().lower()
            if kind not in ("data", "unified"):
                continue            # instruction caches never hold a bucket
            level = int((entry / "level").read_text())
            size = _size_bytes((entry / "size").read_text())
        except (OSError, ValueError):
            continue
        try:
            shared = _parse_cpu_list((entry / "shared_cpu_list").read_text())
        except (OSError, ValueError):
            shared = 1
        if size > 0:
            caches.append(CacheLevel(level, size, shared))
    return tuple(sorted(caches, key=lambda c: (c.level, c.size_bytes)))


def _sysconf_last_level() -> Optional[CacheLevel]:
    """glibc's view of the largest cache (from CPUID), where sysfs gave none; None elsewhere."""
    for name, level in (("SC_LEVEL3_CACHE_SIZE", 3), ("SC_LEVEL2_CACHE_SIZE", 2)):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError, AttributeError):
            continue
        if size and size > 0:
            return CacheLevel(level, size, os.cpu_count() or 1)
    return None


def last_level_share(caches: Sequence[CacheLevel]) -> Optional[int]:
    """Bytes of the last-level cache a copy can count on: the largest level's size, capped at
    :data:`MAX_CACHE_PER_CPU` times the CPUs sharing it; None for no caches."""
    if not caches:
        return None
    top = max(caches, key=lambda c: (c.level, c.size_bytes))
    return min(top.size_bytes, MAX_CACHE_PER_CPU * max(top.shared_cpus, 1))


def thresholds_for(caches: Sequence[CacheLevel], source: str = "sysfs") -> StreamThresholds:
    """The streaming thresholds for a machine with ``caches`` (no caches: an assumed
    :data:`FALLBACK_LAST_LEVEL`): a third of the last-level share, written, for both. The cast
    then streams once its read and written bytes exceed the share; the copy, whose source and
    bucket are two thirds of it, a little before they alone would, where its two store kinds
    were measured to meet (docs/benchmarks/host-path.md, "Stream thresholds from the cache
    size"). Whole cache lines, so a bucket just past a threshold already streams a vector."""
    share = last_level_share(caches)
    if share is None:
        share, source = FALLBACK_LAST_LEVEL, "fallback"
    return StreamThresholds(copy_from_bytes=_whole_lines(share // 3),
                            cast_from_bytes=_whole_lines(share // 3),
                            last_level_bytes=share, source=source)


def _whole_lines(nbytes: int) -> int:
    """``nbytes`` rounded down to whole 64-byte cache lines (at least one)."""
    return max(CACHE_LINE, nbytes // CACHE_LINE * CACHE_LINE)


@functools.lru_cache(maxsize=1)
def stream_thresholds() -> StreamThresholds:
    """This machine's thresholds: from sysfs, else glibc's sysconf, else the fallback; once per
    process (logged at debug)."""
    caches, source = read_caches(), "sysfs"
    if not caches:
        found = _sysconf_last_level()
        caches, source = ((found,), "sysconf") if found is not None else ((), "fallback")
    thresholds = thresholds_for(caches, source)
    logger.debug("host copy streaming thresholds: %s", thresholds)
    return thresholds


def describe_caches(caches: Sequence[CacheLevel]) -> str:
    """``L1 32 KiB, L2 1 MiB, L3 32 MiB (shared by 2)`` for reports; ``unknown`` for none."""
    def size(nbytes: int) -> str:
        return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
    parts = [f"L{c.level} {size(c.size_bytes)}" + (f" (shared by {c.shared_cpus})"
                                                    if c.shared_cpus > 1 else "")
             for c in caches]
    return ", ".join(parts) or "unknown"
