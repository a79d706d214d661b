"""Turns benchmark timings into the ratios the project reports (shared by conftest and the runner),
the runner's JSON into a Markdown report with a chart (``python -m benchmarks report``), and two
result files into a per-case change list (``python -m benchmarks compare``).

One ratio direction everywhere (tables, chart, README): **speed relative to a reference =
reference time / pool time**. Higher is better; 1 is parity. Each ratio comes with a range from
the spread of both sides, ``[reference q1 / pool q3, reference q3 / pool q1]`` (the interquartile
ranges), so a reader sees how much of a ratio is noise.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from benchmarks.cases import MIB, SMALL_COUNT, SMALL_NUMEL
from benchmarks.copy_table import (REFERENCES, copy_rows, copy_timings, size_label, speed_ratio,
                                   time_label, timing_of)

RATIO_FROM_BYTES = MIB       # bandwidth ratios are quoted from 1 MiB up (below: dispatch-bound)
FIXED_COST_BYTES = 4096      # the single-gradient pack whose time is the per-call fixed cost


# -- the runner's JSON: summary, Markdown, chart -------------------------------------------------
def reduce_ratios(reduce_rows: list) -> list[dict]:
    """Pool speed relative to zero-copy (zero-copy step time / pool step time) per (world size,
    comm_fusion)."""
    by_key = {(r["world_size"], r["comm_fusion"], r["method"]): r for r in reduce_rows}
    out = []
    for world, fusion in sorted({(r["world_size"], r["comm_fusion"]) for r in reduce_rows}):
        pool, zero = by_key.get((world, fusion, "pool")), by_key.get((world, fusion, "zero_copy"))
        if pool and zero:
            out.append({"world_size": world, "comm_fusion": fusion,
                        "pool_s": pool["median_s"], "zero_copy_s": zero["median_s"],
                        "speed_vs_zero_copy": speed_ratio(timing_of(zero), timing_of(pool))})
    return out


def summarize(results: dict) -> dict:
    """The derived numbers: copy rows with their ratios, speed relative to memcpy from 1 MiB up
    per dtype pair, the 4 KiB pack's fixed cost, the fused small-gradient pack per gradient, and
    the reduce-step ratios."""
    rows = copy_rows(copy_timings(results))
    pairs: dict = {}
    for row in rows:
        entry = pairs.setdefault(f"{row['grad_dtype']}->{row['bucket_dtype']}", {})
        pool = row["timings"]["pool"]
        if row["count"] == 1 and row["nbytes"] >= RATIO_FROM_BYTES \
                and "speed_vs_memcpy" in row["ratios"]:
            entry.setdefault("speed_vs_memcpy_from_1MiB", {})[size_label(row["nbytes"])] = \
                row["ratios"]["speed_vs_memcpy"]["median"]
        if row["count"] == 1 and row["nbytes"] == FIXED_COST_BYTES:
            entry["pack_4KiB_us"] = _micros(pool)
            beside = row["paired_pool"].get("fresh_alloc")
            if beside is not None:
                entry["pack_4KiB_beside_fresh_alloc_us"] = _micros(beside)
        if "speed_vs_small_op" in row["ratios"]:
            entry["fused_pack_gradients"] = row["count"]
            entry["fused_pack_per_gradient_us"] = pool["median_s"] / row["count"] * 1e6
            entry["fused_pack_speed_vs_small_op"] = row["ratios"]["speed_vs_small_op"]["median"]
    reduce_rows = results.get("reduce") or []
    return {"copy_rows": rows, "copy_by_pair": pairs,
            "reduce_ratios": reduce_ratios(reduce_rows),
            "reduce_new_allocations_after_first": {
                r["name"]: r["new_allocations_after_first"] for r in reduce_rows}}


def _micros(timing: dict) -> dict:
    return {k[:-2]: timing[k] * 1e6 for k in ("median_s", "q1_s", "q3_s", "min_s", "max_s")
            if timing.get(k) is not None}


def _fmt(value, spec: str = ".2f", empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def _ratio(r: Optional[dict]) -> str:
    if r is None:
        return "-"
    return f"{r['median']:.3g} [{r['low']:.3g}, {r['high']:.3g}]"


def _spread(t: Optional[dict]) -> str:
    """``median (IQR x) [min - max], n`` of one timing."""
    if t is None:
        return "-"
    text = f"{time_label(t['median_s'])} (IQR {time_label(t['iqr_s'])})"
    if t.get("min_s") is not None:
        text += f" [{time_label(t['min_s'])} - {time_label(t['max_s'])}]"
    return text


def _caches_text(machine: dict) -> str:
    """``; caches ...; host copies stream from ...`` (files before the caches were recorded: "")."""
    if not machine.get("caches"):
        return ""
    text = f"; caches {machine['caches']}"
    stream = machine.get("stream_thresholds")
    if stream:
        text += (f"; host copies stream from {stream['copy_from_bytes'] / 2**20:.3g} MiB "
                 f"written (casts {stream['cast_from_bytes'] / 2**20:.3g} MiB; from "
                 f"{stream['from']})")
    return text


def markdown(results: dict, chart_name: Optional[str] = None) -> str:
    summary = results.get("summary") or summarize(results)
    m, opts = results["machine"], results["options"]
    commit = m.get("git_commit")
    commit_text = "unknown" if not commit else commit[:12] + (" (with uncommitted changes)"
                                                              if m.get("git_dirty") else "")
    lines = ["# gradpool benchmark results", "",
             f"- Command: `{results['command']}`",
             f"- Date (UTC): {results['created']}; git commit {commit_text}",
             f"- Machine: {m['cpu_model']}, {m['cores']} cores, {m['platform']}"
             f"{_caches_text(m)}",
             f"- Software: Python {m['python']}, MindSpore {m['mindspore']}, NumPy {m['numpy']}, "
             f"ml-dtypes {m.get('ml_dtypes', '?')}, pytest-benchmark "
             f"{m.get('pytest_benchmark', '?')}",
             f"- Device: {m['device']}; sweep: {'quick' if opts['quick'] else 'full'}; "
             f"ranks for the distributed reduce suite: {opts['nproc']}",
             "- Timing: warm-up, then repeated timed rounds (copy cases: rounds fitted to "
             f"~{opts['copy_budget']['seconds']:g} s per case, "
             f"{opts['copy_budget']['min_repeats']}-{opts['copy_budget']['max_repeats']}; "
             f"reduce steps: {opts['reduce_warmup']} warm-up + {opts['reduce_repeats']} timed"
             f"{_fused_repeats(opts)}). "
             "The two sides of every copy ratio are timed interleaved, one call of each per "
             "round, so a ratio compares calls made under the same machine load: pool, memcpy "
             "and zero-copy share one set of rounds; the fresh allocation (MindSpore kernels and "
             "a synchronize, whose after-effects slow whatever runs next) is timed against a "
             "second pool series of its own; the reduce steps of pool and zero-copy alike, one "
             "step of each per round. Times are `median (IQR) [min - max]`; statistics "
             "by pytest-benchmark.",
             "- Ratios: **speed relative to a reference = reference time / pool time; higher is "
             "better, 1 = parity**, with `[low, high]` from the interquartile ranges "
             "(reference q1 / pool q3, reference q3 / pool q1).",
             "- Every case was checked after timing: one untimed run on new random data, "
             "compared with NumPy (packs byte for byte, reduced shards against NumPy's average).",
             ""]
    lines += _copy_section(summary, chart_name) + _fixed_cost_section(summary) + \
        _small_section(summary) + _reduce_section(results, summary) + _profile_section(results)
    return "\n".join(lines) + "\n"


def _fused_repeats(opts: dict) -> str:
    """The fused steps' round count where it differs (result files before it was set have none)."""
    fused = opts.get("fused_reduce_repeats")
    return "" if fused in (None, opts["reduce_repeats"]) else f" ({fused} with comm_fusion)"


def _copy_section(summary: dict, chart_name: Optional[str]) -> list[str]:
    rows = [r for r in summary["copy_rows"] if r["count"] == 1]
    if not rows:
        return []
    out = ["## Copy-in of one gradient", "",
           "Pool: acquire a pool bucket, pack the gradient into it (cast if the dtypes differ), "
           "release. References: " + "; ".join(f"{k}: {v}" for k, v in REFERENCES.items()) +
           ". The memcpy copies the bytes the pack writes (half the gradient's bytes for "
           "float32 -> bfloat16, twice for bfloat16 -> float32).", "",
           "| gradient -> bucket | size | rounds | pool time | pool GB/s (gradient bytes) "
           "| memcpy time | speed vs memcpy | speed vs zero-copy | speed vs fresh alloc |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["grad_dtype"], r["bucket_dtype"], r["nbytes"])):
        ratios, times = r["ratios"], r["timings"]
        out.append(f"| {r['grad_dtype']} -> {r['bucket_dtype']} | {size_label(r['nbytes'])} "
                   f"| {_fmt(times['pool']['rounds'], 'd')} | {_spread(times['pool'])} "
                   f"| {r['pool_gbps']:.3g} | {_spread(times['memcpy'])} "
                   f"| {_ratio(ratios.get('speed_vs_memcpy'))} "
                   f"| {_ratio(ratios.get('speed_vs_zero_copy'))} "
                   f"| {_ratio(ratios.get('speed_vs_fresh_alloc'))} |")
    out.append("")
    if chart_name:
        out += [f"![copy-in speed relative to memcpy and to a fresh allocation, by gradient "
                f"size (higher is better)]({chart_name})", ""]
    return out


def _fixed_cost_section(summary: dict) -> list[str]:
    pairs = {p: e for p, e in summary["copy_by_pair"].items() if "pack_4KiB_us" in e}
    if not pairs:
        return []
    out = ["## Fixed cost per call", "",
           f"One {size_label(FIXED_COST_BYTES)} gradient: acquire, pack, release (the whole "
           "per-call cost of a small copy-in), timed beside memcpy and zero-copy; the last "
           "column is the same call timed beside a fresh allocation (MindSpore kernels and a "
           "synchronize in every round, as in training, where a pack follows backward's ops).",
           "",
           "| gradient -> bucket | median (us) | q1 - q3 (us) | min (us) | max (us) "
           "| beside a fresh allocation: median (q1 - q3) (us) |",
           "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for pair, entry in sorted(pairs.items()):
        t, beside = entry["pack_4KiB_us"], entry.get("pack_4KiB_beside_fresh_alloc_us")
        other = "-" if beside is None else \
            f"{beside['median']:.1f} ({beside['q1']:.1f} - {beside['q3']:.1f})"
        out.append(f"| {pair.replace('->', ' -> ')} | {t['median']:.1f} "
                   f"| {t['q1']:.1f} - {t['q3']:.1f} | {_fmt(t.get('min'), '.1f')} "
                   f"| {_fmt(t.get('max'), '.1f')} | {other} |")
    return out + [""]


def _small_section(summary: dict) -> list[str]:
    rows = [r for r in summary["copy_rows"] if "speed_vs_small_op" in r["ratios"]]
    if not rows:
        return []
    out = ["## Many small gradients in one fused bucket", "",
           f"Packing {SMALL_COUNT} gradients of {SMALL_NUMEL} elements into one bucket, against "
           f"one small MindSpore op per gradient (a {SMALL_NUMEL}-element add: what a "
           "per-parameter Python loop of ops pays). Speed vs small op = small-op time / pool "
           "time per gradient; at least 1 means at most one small op's cost per gradient.", "",
           "| gradient -> bucket | gradients | pool time (all) | pool per gradient (us) "
           "| speed vs one small op per gradient |",
           "| --- | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["grad_dtype"], r["bucket_dtype"])):
        pool = r["timings"]["pool"]
        out.append(f"| {r['grad_dtype']} -> {r['bucket_dtype']} | {r['count']} "
                   f"| {_spread(pool)} | {pool['median_s'] / r['count'] * 1e6:.2f} "
                   f"| {_ratio(r['ratios']['speed_vs_small_op'])} |")
    return out + [""]


def _reduce_section(results: dict, summary: dict) -> list[str]:
    rows = results.get("reduce") or []
    if not rows:
        return []
    first = rows[0]
    out = ["## Reduce step: the whole reduce path for the tiny DeepSeek-V3 gradients", "",
           f"{first['gradients']} float32 gradients ({first['grad_bytes'] / 1024:.1f} KiB), "
           "pack or borrow -> reduce-scatter -> wait -> shard views -> release. Pool: copy into "
           "512-byte aligned buckets; zero-copy: 4-byte alignment, so every gradient whose dim 0 "
           "divides by the world size is borrowed in place (fused buckets are never borrowed).",
           "",
           "Op launch: `async` is PyNative's default; `blocking` runs every op synchronously, as "
           "`gradpool train` runs CPU ranks (`launch.launch_blocking`).",
           "",
           "| world | comm_fusion | method | communicator | op launch | rounds | step time "
           "| new allocations (step 1 / after) | pool high-water | copied per step "
           "| borrowed per step |",
           "| ---: | --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["comm_fusion"], r["method"])):
        out.append(f"| {r['world_size']} | {'on' if r['comm_fusion'] else 'off'} | {r['method']} "
                   f"| {r['communicator']} | {r.get('op_launch', 'async')} "
                   f"| {timing_of(r)['rounds']} | {_spread(timing_of(r))} "
                   f"| {r['new_allocations_first_step']} / {r['new_allocations_after_first']} "
                   f"| {r['high_water_bytes'] / 1024:.1f} KiB "
                   f"| {r['bytes_copied_per_step'] / 1024:.1f} KiB | {r['borrows_per_step']:.0f} |")
    out += ["", "| world | comm_fusion | pool speed vs zero-copy (zero-copy time / pool time) |",
            "| ---: | --- | ---: |"]
    for r in summary["reduce_ratios"]:
        out.append(f"| {r['world_size']} | {'on' if r['comm_fusion'] else 'off'} "
                   f"| {_ratio(r['speed_vs_zero_copy'])} |")
    return out + [""]


def _profile_section(results: dict) -> list[str]:
    """The fused step's phases per rank (:mod:`benchmarks.phase_profile`), pool beside
    zero-copy, medians; absent from files written before the profile existed."""
    from benchmarks.phase_profile import PHASES
    profiles = results.get("reduce_profile") or []
    if not profiles:
        return []
    first = profiles[0]
    out = ["## Where a fused reduce step's time goes, per rank", "",
           f"{first['steps']} fused steps per method on {first['world_size']} ranks "
           f"({first['communicator']}), pool and zero-copy interleaved, the ranks lined up by an "
           "untimed all-reduce before every step; each phase timed on its rank's clock, medians "
           "over the steps (phases nest: the collective, average and result write are parts of "
           "the reduce-scatter; the step holds the rest, the wait for results and the release). "
           "Both methods make the same calls on a fused bucket and differ in alignment only, so "
           "a step that differs by more than its pack differs in where the peer was.", "",
           "| rank | phase | pool | zero-copy | pool - zero-copy |",
           "| ---: | --- | ---: | ---: | ---: |"]
    for profile in sorted(profiles, key=lambda p: p["rank"]):
        pool, zero_copy = profile["phases"]["pool"], profile["phases"]["zero_copy"]
        for phase in PHASES:
            if phase not in pool or phase not in zero_copy:
                continue
            a, b = pool[phase]["median_s"], zero_copy[phase]["median_s"]
            out.append(f"| {profile['rank']} | {phase} | {_spread(pool[phase])} "
                       f"| {_spread(zero_copy[phase])} "
                       f"| {'-' if a < b else '+'}{time_label(abs(a - b))} |")
    return out + [""]


def write_report(results_path: Path, out_dir: Optional[Path] = None) -> list[Path]:
    """``<stem>.md`` (and ``<stem>-copy-speed.png`` when there are copy results) in ``out_dir``
    (default: beside the JSON). Returns the paths written."""
    from benchmarks.chart import plot_copy_speed
    results_path = Path(results_path)
    results = json.loads(results_path.read_text(encoding="utf-8"))
    out_dir = Path(out_dir) if out_dir is not None else results_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    chart = out_dir / f"{results_path.stem}-copy-speed.png"
    if plot_copy_speed(results, chart):
        written.append(chart)
    md = out_dir / f"{results_path.stem}.md"
    md.write_text(markdown(results, chart.name if written else None), encoding="utf-8")
    return [md] + written


# -- compare two result files --------------------------------------------------------------------
def case_timings(results: dict) -> dict:
    """``{case name: timing}`` over every timed case of a results file."""
    copy = results.get("copy") or {}
    out = {f"copy {c['name']}": timing_of(c) for c in copy.get("cases", [])}
    out.update({f"copy {c['name']} (its pool series)": timing_of(c["paired_pool"])
                for c in copy.get("cases", []) if c.get("paired_pool")})
    if copy.get("small_op"):
        out["copy small-op reference"] = timing_of(copy["small_op"])
    # A blocking-launch row is another case than an async one of the same name: never compared.
    out.update({f"reduce {r['name']}" + (" (blocking launch)" if r.get("op_launch") == "blocking"
                                         else ""): timing_of(r)
                for r in results.get("reduce") or []})
    return out


def compare(old: dict, new: dict, fail_above: Optional[float] = None) -> tuple[list[str], list]:
    """Per case of both files: old and new median with IQR, and the change of the median.
    Returns the lines and the regressions: cases whose median time grew by more than
    ``fail_above`` percent (pytest-benchmark's ``PercentageRegressionCheck`` on ``median``)."""
    from pytest_benchmark.utils import PercentageRegressionCheck
    check = PercentageRegressionCheck("median", fail_above) if fail_above is not None else None
    before, after = case_timings(old), case_timings(new)
    lines = [f"{'case':58} {'old median (IQR)':>24} {'new median (IQR)':>24} {'change':>8}"]
    regressions = []
    for name in sorted(set(before) & set(after)):
        o, n = before[name], after[name]
        change = n["median_s"] / o["median_s"] * 100 - 100
        # Overlapping interquartile ranges: the change is within the runs' own spread.
        overlap = n["q1_s"] <= o["q3_s"] and o["q1_s"] <= n["q3_s"]
        note = ""
        if check is not None and check.fails({"median": n["median_s"]}, {"median": o["median_s"]}):
            regressions.append(name)
            note = f"  REGRESSION (> {fail_above:g}% slower)"
        elif overlap:
            note = "  (within spread)"
        lines.append(f"{name:58} {_compact(o):>24} {_compact(n):>24} {change:+7.1f}%{note}")
    for name in sorted(set(before) - set(after)):
        lines.append(f"{name:58} only in the old file")
    for name in sorted(set(after) - set(before)):
        lines.append(f"{name:58} only in the new file")
    return lines, regressions


def _compact(t: dict) -> str:
    return f"{time_label(t['median_s'])} ({time_label(t['iqr_s'])})"


# -- command lines -------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks report",
                                     description="Markdown tables and a PNG chart from a "
                                                 "results JSON.")
    parser.add_argument("results", help="JSON written by `python -m benchmarks run`")
    parser.add_argument("--out-dir", default=None, help="default: beside the JSON")
    args = parser.parse_args(argv)
    try:
        written = write_report(Path(args.results), args.out_dir)
    except (OSError, ValueError, KeyError) as exc:
        print(f"benchmarks report: cannot report {args.results}: {exc!r}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


def compare_main(argv=None) -> int:
    """``python -m benchmarks compare OLD.json NEW.json [--fail-above PCT]``: 0, or 1 when a
    case's median time grew by more than PCT percent; 2 on unreadable input."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks compare",
                                     description="Per-case change of the median time between "
                                                 "two results files.")
    parser.add_argument("old", help="the baseline results JSON")
    parser.add_argument("new", help="the results JSON to judge")
    parser.add_argument("--fail-above", type=float, default=None, metavar="PCT",
                        help="exit 1 if any case's median time is more than PCT percent slower")
    args = parser.parse_args(argv)
    try:
        old, new = (json.loads(Path(p).read_text(encoding="utf-8")) for p in (args.old, args.new))
        lines, regressions = compare(old, new, args.fail_above)
    except (OSError, ValueError, KeyError) as exc:
        print(f"benchmarks compare: cannot compare {args.old} and {args.new}: {exc!r}",
              file=sys.stderr)
        return 2
    print("\n".join(lines))
    if regressions:
        print(f"{len(regressions)} case(s) slower by more than {args.fail_above:g}%: "
              + ", ".join(regressions), file=sys.stderr)
        return 1
    return 0
