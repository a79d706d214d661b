"""The cache sizes the host copies' streaming thresholds come from (gradpool.host.caches): sysfs
trees of several machines written to a temporary directory, a missing or broken sysfs, and the
map from sizes to thresholds. No MindSpore, no numba."""
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpool.host import caches
from gradpool.host.caches import CacheLevel, read_caches, thresholds_for

KIB, MIB = 1 << 10, 1 << 20


def lines(nbytes: int) -> int:
    """Whole 64-byte cache lines, rounded down."""
    return nbytes // 64 * 64


def write_sysfs(root: Path, entries) -> Path:
    """``root/index{i}/{level,type,size,shared_cpu_list}`` as Linux writes them."""
    for index, (level, kind, size, shared) in enumerate(entries):
        folder = root / f"index{index}"
        folder.mkdir(parents=True)
        (folder / "level").write_text(f"{level}\n")
        (folder / "type").write_text(f"{kind}\n")
        (folder / "size").write_text(f"{size}\n")
        if shared is not None:
            (folder / "shared_cpu_list").write_text(f"{shared}\n")
    return root


# (sysfs entries, expected last-level share, copy threshold, cast threshold)
MACHINES = {
    # 2 vCPUs of an AMD EPYC (Zen 4) VM: the 32 MiB L3 of one die, both vCPUs on it.
    "epyc-2vcpu-32M": ([(1, "Data", "32K", "0"), (1, "Instruction", "32K", "0"),
                        (2, "Unified", "1024K", "0"), (3, "Unified", "32768K", "0-1")],
                       32 * MIB, lines(32 * MIB // 3), lines(32 * MIB // 3)),
    # a VM reporting its host's whole 480 MiB L3 to 2 vCPUs: capped at 16 MiB per vCPU
    "vm-reports-host-480M": ([(1, "Data", "48K", "0"), (2, "Unified", "2048K", "0"),
                              (3, "Unified", "491520K", "0-1")],
                             32 * MIB, lines(32 * MIB // 3), lines(32 * MIB // 3)),
    # a small desktop part: 8 MiB L3 shared by 8 CPUs (under the cap)
    "desktop-8M": ([(1, "Data", "32K", "0,4"), (2, "Unified", "256K", "0,4"),
                    (3, "Unified", "8M", "0-7")], 8 * MIB, lines(8 * MIB // 3), lines(8 * MIB // 3)),
    # no L3 at all: the L2 is the last level; shared_cpu_list missing counts as 1 CPU
    "l2-only-no-shared-list": ([(1, "Data", "64K", None), (2, "Unified", "4096K", None)],
                               4 * MIB, lines(4 * MIB // 3), lines(4 * MIB // 3)),
    # an L3 of one CPU above the per-CPU cap (a VM that pins the host's L3 to one vCPU)
    "one-cpu-96M": ([(1, "Data", "32K", "0"), (3, "Unified", "96M", "0")],
                    16 * MIB, lines(16 * MIB // 3), lines(16 * MIB // 3)),
}


@pytest.mark.parametrize("name", list(MACHINES))
def test_thresholds_from_a_sysfs_tree(name, tmp_path):
    entries, share, copy_from, cast_from = MACHINES[name]
    found = read_caches(write_sysfs(tmp_path, entries))
    assert all(c.level in (1, 2, 3) for c in found)
    thresholds = thresholds_for(found)
    assert (thresholds.last_level_bytes, thresholds.copy_from_bytes,
            thresholds.cast_from_bytes, thresholds.source) == (share, copy_from, cast_from,
                                                                 "sysfs")


def test_instruction_caches_are_left_out(tmp_path):
    found = read_caches(write_sysfs(tmp_path, MACHINES["epyc-2vcpu-32M"][0]))
    assert found == (CacheLevel(1, 32 * KIB, 1), CacheLevel(2, MIB, 1),
                     CacheLevel(3, 32 * MIB, 2))


def test_missing_sysfs_gives_no_caches_and_the_fallback(tmp_path):
    assert read_caches(tmp_path / "absent") == ()
    assert read_caches(tmp_path) == ()            # present but empty
    thresholds = thresholds_for(())
    assert thresholds.source == "fallback"
    assert thresholds.last_level_bytes == caches.FALLBACK_LAST_LEVEL
    assert thresholds.copy_from_bytes == lines(caches.FALLBACK_LAST_LEVEL // 3)
    assert thresholds.cast_from_bytes == lines(caches.FALLBACK_LAST_LEVEL // 3)


def test_malformed_entries_are_skipped_not_guessed(tmp_path):
    write_sysfs(tmp_path, [(1, "Data", "32K", "0"), (2, "Unified", "1024K", "0"),
                           (3, "Unified", "lots", "0-1")])
    (tmp_path / "index9").mkdir()                 # an entry with no files at all
    assert read_caches(tmp_path) == (CacheLevel(1, 32 * KIB), CacheLevel(2, MIB))
    assert thresholds_for(read_caches(tmp_path)).copy_from_bytes == lines(MIB // 3)


def test_without_sysfs_the_machine_reads_sysconf_then_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(caches, "SYSFS_CACHES", tmp_path / "absent")
    monkeypatch.setattr(caches, "read_caches", lambda root=None: ())
    monkeypatch.setattr(caches.os, "sysconf",
                        lambda name: 8 * MIB if name == "SC_LEVEL3_CACHE_SIZE" else 0)
    monkeypatch.setattr(caches.os, "cpu_count", lambda: 4)
    caches.stream_thresholds.cache_clear()
    try:
        found = caches.stream_thresholds()
        assert (found.source, found.copy_from_bytes) == ("sysconf", lines(8 * MIB // 3))

        def no_sysconf(name):
            raise ValueError(name)
        monkeypatch.setattr(caches.os, "sysconf", no_sysconf)
        caches.stream_thresholds.cache_clear()
        assert caches.stream_thresholds().source == "fallback"
    finally:
        caches.stream_thresholds.cache_clear()


@pytest.mark.parametrize("text,count", [("0", 1), ("0-1", 2), ("0-3,8,10-11", 7), ("", 1)])
def test_cpu_lists(text, count):
    assert caches._parse_cpu_list(text) == count


levels = st.lists(st.builds(CacheLevel, level=st.integers(1, 4),
                            size_bytes=st.integers(1, 1 << 34),
                            shared_cpus=st.integers(1, 512)), max_size=6)


@settings(max_examples=300, deadline=None)
@given(levels)
def test_thresholds_never_exceed_what_the_cache_can_hold(found):
    """Both stream from a third of the share, in whole lines (the cast once its 3 bytes per byte
    written exceed it); the share is never more than the largest cache nor the per-CPU cap
    allows."""
    thresholds = thresholds_for(found)
    share = thresholds.last_level_bytes
    copy_from, cast_from = thresholds.copy_from_bytes, thresholds.cast_from_bytes
    assert copy_from % 64 == 0 and cast_from % 64 == 0
    if share >= 3 * 64:
        assert copy_from * 3 <= share < (copy_from + 64) * 3
        assert cast_from * 3 <= share < (cast_from + 64) * 3
    else:                           # a cache under three lines: one line each
        assert copy_from == cast_from == 64
    assert cast_from <= copy_from
    if found:
        top = max(found, key=lambda c: (c.level, c.size_bytes))
        assert share == min(top.size_bytes, caches.MAX_CACHE_PER_CPU * top.shared_cpus)


@settings(max_examples=200, deadline=None)
@given(levels, st.integers(1, 1 << 30))
def test_a_larger_last_level_cache_never_lowers_a_threshold(found, extra):
    if not found:
        return
    top = max(found, key=lambda c: (c.level, c.size_bytes))
    bigger = [c for c in found if c is not top] + [
        CacheLevel(top.level, top.size_bytes + extra, top.shared_cpus)]
    assert thresholds_for(bigger).copy_from_bytes >= thresholds_for(found).copy_from_bytes
    assert thresholds_for(bigger).cast_from_bytes >= thresholds_for(found).cast_from_bytes


def test_this_machine_has_thresholds_the_kernels_use():
    from gradpool.host import kernels
    mine = caches.stream_thresholds()
    assert mine.copy_from_bytes > 0 and mine.cast_from_bytes > 0
    assert (kernels.COPY_STREAM_FROM_BYTES, kernels.STREAM_FROM_BYTES) == (
        mine.copy_from_bytes, mine.cast_from_bytes)
