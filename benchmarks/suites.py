"""The two suites the runner times: copy-in (benchmarks.cases copy cases) and the reduce step.

Each returns plain dicts (JSON-ready). The copy suite runs in one process and fits its repeat
count to a time budget; the reduce suite makes the same calls on every rank (its collectives must
match), so its warm-up and repeat counts are fixed. After timing, every case runs its untimed
``check()`` (``benchmarks.cases``); a case whose result is wrong raises ``BenchmarkError``
and no timing of it is reported.
"""
from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field

from benchmarks.cases import (COPY_SIZES, DTYPE_PAIRS, KIB, MIB, SMALL_COUNT, SMALL_NUMEL,
                              copy_cases, make_copy, make_reduce_step, make_small_op,
                              reduce_cases)
from benchmarks.timing import (Budget, measure_budget, measure_interleaved,
                               measure_interleaved_fixed)
from gradpool.device import launches_blocking


@dataclass(frozen=True)
class SuiteSettings:
    copy_sizes: tuple = COPY_SIZES
    copy_pairs: tuple = DTYPE_PAIRS
    copy_budget: Budget = field(default_factory=Budget)
    reduce_warmup: int = 3
    reduce_repeats: int = 100
    # A fused 2-rank step takes ~3 ms with an IQR of ~1 ms (the collective waits for the peer):
    # at 100 rounds its median is uncertain by about 3 %, the difference it is read for.
    fused_reduce_repeats: int = 500
    profile_steps: int = 300        # fused steps per method of the phase profile (N ranks)

    def to_dict(self) -> dict:
        return asdict(self)


FULL = SuiteSettings()
# Quick: a smoke run. bfloat16 gradients are left out: on CPU their first 1000-gradient pack
# takes seconds (a first-call cost of bfloat16 cat/cast), more than the rest of the sweep.
QUICK = SuiteSettings(copy_sizes=(4 * KIB, MIB),
                      copy_pairs=(("float32", "float32"), ("float32", "bfloat16")),
                      copy_budget=Budget(warmup=1, seconds=0.05, min_repeats=3, max_repeats=10),
                      reduce_warmup=1, reduce_repeats=3, fused_reduce_repeats=4,
                      profile_steps=3)


def _verify(run) -> None:
    """The case's untimed check; a wrong result ends the run as a :class:`BenchmarkError`."""
    from benchmarks.cases import BenchmarkCheckError, BenchmarkError
    try:
        run.check()
    except BenchmarkCheckError as exc:
        raise BenchmarkError(f"check failed, no timing reported: {exc}") from exc


class _NoBar(list):
    def set_postfix_str(self, *args, **kwargs):
        pass


def _progress(items, desc: str, show: bool):
    if not show:
        return _NoBar(items)
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="case", dynamic_ncols=True)


# Timed interleaved with the pool in one set: NumPy-only or no-op references. A fresh allocation
# launches MindSpore kernels and synchronizes; the runtime's threads it wakes and the caches it
# evicts slowed whatever ran next in its round by up to 2x (a 4 KiB pack: 17 us next to memcpy,
# 34-39 us with a fresh allocation in the round, load average ~10), so it gets a set of its own
# with another pool series: each ratio compares two sides timed next to each other only.
HOST_SET = ("pool", "memcpy", "zero_copy")


def run_copy_suite(settings: SuiteSettings, show_progress: bool = True) -> dict:
    """Every copy case of ``settings.copy_sizes`` x ``settings.copy_pairs`` (plus the
    1000-gradient fused packs) and the small-op reference:
    ``{"cases": [...], "small_op": {...}}``.

    The two sides of every ratio are timed **interleaved**, one call of each per round
    (:func:`measure_interleaved`): on a shared machine the load changes from second to second,
    and a ratio of two timings taken minutes apart measures the load as much as the code. The
    pool, memcpy and zero-copy of one (dtype pair, size) share one set of rounds; the fresh
    allocation is timed against a second pool series (its row's ``paired_pool``, what its ratio
    uses; see :data:`HOST_SET`)."""
    rows = []
    groups: dict = {}
    for case in copy_cases(sizes=settings.copy_sizes, pairs=settings.copy_pairs):
        groups.setdefault((case.grad_dtype, case.bucket_dtype, case.nbytes, case.count),
                          []).append(case)
    bar = _progress(list(groups.values()), "copy-in", show_progress)
    for cases in bar:
        bar.set_postfix_str(cases[0].name.split("-", 1)[1], refresh=False)
        runs = {case.method: make_copy(case) for case in cases}
        host = {m: runs[m] for m in HOST_SET if m in runs}
        timings = measure_interleaved(host, settings.copy_budget)
        sets = {m: list(host) for m in host}
        paired = {}
        for method in (m for m in runs if m not in host):
            pair = measure_interleaved({"pool": runs["pool"], method: runs[method]},
                                       settings.copy_budget)
            timings[method], paired[method] = pair[method], pair["pool"]
            sets[method] = ["pool", method]
        for case in cases:
            run, timing = runs[case.method], timings[case.method]
            _verify(run)
            row = {"name": case.name, "method": case.method, "grad_dtype": case.grad_dtype,
                   "bucket_dtype": case.bucket_dtype, "nbytes": case.nbytes,
                   "count": case.count, "bucket_nbytes": case.bucket_nbytes,
                   **timing.to_dict(), "gbps": case.nbytes / timing.median_s / 1e9,
                   "interleaved_with": [m for m in sets[case.method] if m != case.method],
                   "verified": True}
            if case.method in paired:
                row["paired_pool"] = paired[case.method].to_dict()
            pool = getattr(run, "pool", None)
            if pool is not None:
                row["new_allocations"] = pool.stats().new_allocations
            rows.append(row)
        del runs
        gc.collect()      # the 256 MiB cases: give their tensors back before the next group
    small = measure_budget(make_small_op(), settings.copy_budget)
    return {"cases": rows,
            "small_op": {"count": SMALL_COUNT, "numel": SMALL_NUMEL, **small.to_dict()}}


def run_reduce_suite(comm, settings: SuiteSettings, show_progress: bool = True) -> list[dict]:
    """Every reduce case at ``comm``'s world size; one dict each. Call it on every rank.

    The methods of one ``comm_fusion`` setting (pool, zero-copy) are timed interleaved, one step
    of each per round, with fixed counts (every rank makes the same collectives)."""
    rows = []
    groups: dict = {}
    for case in reduce_cases(comm.world_size):
        groups.setdefault(case.comm_fusion, []).append(case)
    bar = _progress(list(groups.values()), f"reduce w{comm.world_size}", show_progress)
    for cases in bar:
        bar.set_postfix_str(cases[0].name, refresh=False)
        runs, first = {}, {}
        for case in cases:
            run = make_reduce_step(case, comm)
            run()                                   # step 1: the pool reserves its buckets
            runs[case.name], first[case.name] = run, run.pool.stats()
        repeats = settings.fused_reduce_repeats if cases[0].comm_fusion \
            else settings.reduce_repeats
        timings = measure_interleaved_fixed(runs, settings.reduce_warmup, repeats)
        for case in cases:
            run, timing = runs[case.name], timings[case.name]
            stats = run.pool.stats()
            steps = 1 + timing.warmup + timing.repeats
            borrows = run.reducer.borrows
            _verify(run)                            # every rank: it runs collectives
            rows.append({
                "name": case.name, "method": case.method, "comm_fusion": case.comm_fusion,
                "world_size": case.world_size, "communicator": type(comm).__name__,
                "op_launch": "blocking" if launches_blocking() else "async",
                "alignment_bytes": case.alignment_bytes, "gradients": run.gradients,
                "grad_bytes": run.grad_bytes, **timing.to_dict(),
                "new_allocations_first_step": first[case.name].new_allocations,
                "new_allocations_after_first":
                    stats.new_allocations - first[case.name].new_allocations,
                "high_water_bytes": stats.high_water_bytes,
                "bytes_copied_per_step": stats.bytes_copied / steps,
                "borrows_per_step": borrows / steps,
                "live_leases_after": stats.live_leases,
                "interleaved_with": [c.method for c in cases if c is not case],
                "verified": True,
            })
        del runs
        gc.collect()
    return rows
