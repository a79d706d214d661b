"""Turns benchmark medians into the ratios the project reports (shared by conftest and the runner),
and the runner's JSON into a Markdown report with a chart (``python -m benchmarks report``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

from benchmarks.cases import MIB, SMALL_COUNT, SMALL_NUMEL

Key = tuple  # (method, grad_dtype, bucket_dtype, nbytes, count)


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes / 1024:g} KiB"


def copy_rows(medians: dict) -> list[dict]:
    """One row per (dtype pair, size, count) with each method's time and the pool's ratios."""
    rows = []
    groups = sorted({k[1:] for k in medians if k[0] == "pool"}, key=lambda g: (g[3], g[0], g[1], g[2]))
    small_op = medians.get(("small_op", None, None, None, SMALL_COUNT))
    for grad_dtype, bucket_dtype, nbytes, count in groups:
        times = {m: medians.get((m, grad_dtype, bucket_dtype, nbytes, count))
                 for m in ("pool", "zero_copy", "fresh_alloc", "memcpy")}
        pool = times["pool"]
        row = dict(grad_dtype=grad_dtype, bucket_dtype=bucket_dtype, nbytes=nbytes, count=count,
                   seconds=times, pool_gbps=nbytes / pool / 1e9)
        if times["memcpy"]:
            row["pool_vs_memcpy_bandwidth"] = times["memcpy"] / pool
        if times["fresh_alloc"]:
            row["pool_vs_fresh_alloc_time"] = pool / times["fresh_alloc"]
        if times["zero_copy"]:
            row["pool_vs_zero_copy_time"] = pool / times["zero_copy"]
        if count > 1 and small_op:
            row["per_gradient_op_units"] = (pool / count) / (small_op / SMALL_COUNT)
        rows.append(row)
    return rows


def copy_ratios(medians: dict) -> list[str]:
    lines = []
    for row in copy_rows(medians):
        what = f"{row['count']} x " if row["count"] > 1 else ""
        text = (f"pool {row['grad_dtype']}->{row['bucket_dtype']} {what}{_size(row['nbytes'])}: "
                f"{row['pool_gbps']:.2f} GB/s")
        if "pool_vs_memcpy_bandwidth" in row:
            text += f", {row['pool_vs_memcpy_bandwidth']:.2f} x memcpy bandwidth"
        if "pool_vs_fresh_alloc_time" in row:
            text += f", {row['pool_vs_fresh_alloc_time']:.2f} x fresh-alloc time"
        if "per_gradient_op_units" in row:
            text += f", {row['per_gradient_op_units']:.2f} small ops per gradient"
        lines.append(text)
    return lines


# -- the runner's JSON: summary, Markdown, chart -------------------------------------------------
RATIO_FROM_BYTES = MIB       # bandwidth ratios are quoted from 1 MiB up (below: dispatch-bound)


def copy_medians(results: dict) -> dict:
    """The runner's copy rows as the ``{Key: median seconds}`` dict :func:`copy_rows` takes."""
    copy = results.get("copy") or {}
    medians = {(c["method"], c["grad_dtype"], c["bucket_dtype"], c["nbytes"], c["count"]):
               c["median_s"] for c in copy.get("cases", [])}
    small = copy.get("small_op")
    if small:
        medians[("small_op", None, None, None, small["count"])] = small["median_s"]
    return medians


def reduce_ratios(reduce_rows: list) -> list[dict]:
    """Pool / zero-copy step time per (world size, comm_fusion)."""
    by_key = {(r["world_size"], r["comm_fusion"], r["method"]): r for r in reduce_rows}
    out = []
    for world, fusion in sorted({(r["world_size"], r["comm_fusion"]) for r in reduce_rows}):
        pool, zero = by_key.get((world, fusion, "pool")), by_key.get((world, fusion, "zero_copy"))
        if pool and zero:
            out.append({"world_size": world, "comm_fusion": fusion,
                        "pool_s": pool["median_s"], "zero_copy_s": zero["median_s"],
                        "pool_vs_zero_copy_time": pool["median_s"] / zero["median_s"]})
    return out


def summarize(results: dict) -> dict:
    """The derived numbers: copy ratios per row, pool/memcpy bandwidth from 1 MiB up per dtype
    pair, per-gradient cost of the fused small-gradient pack, reduce-step ratios."""
    rows = copy_rows(copy_medians(results))
    pairs: dict = {}
    for row in rows:
        pair = f"{row['grad_dtype']}->{row['bucket_dtype']}"
        entry = pairs.setdefault(pair, {})
        if row["count"] == 1 and row["nbytes"] >= RATIO_FROM_BYTES \
                and "pool_vs_memcpy_bandwidth" in row:
            entry.setdefault("pool_vs_memcpy_bandwidth_from_1MiB", {})[
                _size(row["nbytes"])] = row["pool_vs_memcpy_bandwidth"]
        if "per_gradient_op_units" in row:
            entry["fused_pack_gradients"] = row["count"]
            entry["fused_pack_per_gradient_us"] = row["seconds"]["pool"] / row["count"] * 1e6
            entry["fused_pack_per_gradient_op_units"] = row["per_gradient_op_units"]
    reduce_rows = results.get("reduce") or []
    return {"copy_rows": rows, "copy_by_pair": pairs,
            "reduce_ratios": reduce_ratios(reduce_rows),
            "reduce_new_allocations_after_first": {
                r["name"]: r["new_allocations_after_first"] for r in reduce_rows}}


def _fmt(value, spec: str = ".2f", empty: str = "-") -> str:
    return empty if value is None else format(value, spec)


def markdown(results: dict, chart_name: Optional[str] = None) -> str:
    summary = results.get("summary") or summarize(results)
    m, opts = results["machine"], results["options"]
    lines = ["# gradpool benchmark results", "",
             f"- Command: `{results['command']}`",
             f"- Date (UTC): {results['created']}",
             f"- Machine: {m['cpu_model']}, {m['cores']} cores, {m['platform']}",
             f"- Software: Python {m['python']}, MindSpore {m['mindspore']}, NumPy {m['numpy']}",
             f"- Device: {m['device']}; sweep: {'quick' if opts['quick'] else 'full'}; "
             f"ranks for the distributed reduce suite: {opts['nproc']}",
             "- Timing: warm-up, then the median of repeated runs (copy cases: repeats fitted to "
             f"~{opts['copy_budget']['seconds']:g} s per case, "
             f"{opts['copy_budget']['min_repeats']}-{opts['copy_budget']['max_repeats']}; "
             f"reduce steps: {opts['reduce_warmup']} warm-up + {opts['reduce_repeats']} timed)", ""]
    lines += _copy_section(summary, chart_name) + _small_section(summary) + \
        _reduce_section(results, summary)
    return "\n".join(lines) + "\n"


def _copy_section(summary: dict, chart_name: Optional[str]) -> list[str]:
    rows = [r for r in summary["copy_rows"] if r["count"] == 1]
    if not rows:
        return []
    out = ["## Copy-in of one gradient: pool against memcpy, zero-copy and a fresh allocation", "",
           "Pool: pack into a leased pool bucket (cast if the dtypes differ). memcpy: NumPy copy "
           "of the same bytes. Zero-copy: the collective reads the gradient in place (same dtype "
           "only). Fresh alloc: upstream style, a new buffer each step, copied into.", "",
           "| gradient -> bucket | size | pool GB/s | memcpy GB/s | pool / memcpy bandwidth "
           "| pool / zero-copy time | pool / fresh-alloc time |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["grad_dtype"], r["bucket_dtype"], r["nbytes"])):
        memcpy = r["seconds"].get("memcpy")
        out.append(f"| {r['grad_dtype']} -> {r['bucket_dtype']} | {_size(r['nbytes'])} "
                   f"| {r['pool_gbps']:.3g} "
                   f"| {_fmt(r['nbytes'] / memcpy / 1e9 if memcpy else None, '.3g')} "
                   f"| {_fmt(r.get('pool_vs_memcpy_bandwidth'), '.3g')} "
                   f"| {_fmt(r.get('pool_vs_zero_copy_time'), '.3g')} "
                   f"| {_fmt(r.get('pool_vs_fresh_alloc_time'), '.3g')} |")
    out.append("")
    if chart_name:
        out += [f"![copy overhead against gradient size]({chart_name})", ""]
    return out


def _small_section(summary: dict) -> list[str]:
    pairs = {p: e for p, e in summary["copy_by_pair"].items() if "fused_pack_gradients" in e}
    if not pairs:
        return []
    out = ["## Many small gradients in one fused bucket", "",
           f"Cost per gradient of packing {SMALL_COUNT} gradients of {SMALL_NUMEL} elements into "
           f"one bucket, in units of one small MindSpore op (a {SMALL_NUMEL}-element add): what a "
           "per-parameter Python loop of ops would pay is about 1 unit per gradient.", "",
           "| gradient -> bucket | gradients | pool per gradient (us) "
           "| small-op units per gradient |",
           "| --- | ---: | ---: | ---: |"]
    for pair, e in sorted(pairs.items()):
        out.append(f"| {pair.replace('->', ' -> ')} | {e['fused_pack_gradients']} "
                   f"| {e['fused_pack_per_gradient_us']:.2f} "
                   f"| {e['fused_pack_per_gradient_op_units']:.3f} |")
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
           "| world | comm_fusion | method | communicator | step time (ms) | new allocations "
           "(step 1 / after) | pool high-water | copied per step | borrowed per step |",
           "| ---: | --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (r["world_size"], r["comm_fusion"], r["method"])):
        out.append(f"| {r['world_size']} | {'on' if r['comm_fusion'] else 'off'} | {r['method']} "
                   f"| {r['communicator']} | {r['median_s'] * 1e3:.2f} "
                   f"| {r['new_allocations_first_step']} / {r['new_allocations_after_first']} "
                   f"| {r['high_water_bytes'] / 1024:.1f} KiB "
                   f"| {r['bytes_copied_per_step'] / 1024:.1f} KiB | {r['borrows_per_step']:.0f} |")
    out += ["", "| world | comm_fusion | pool / zero-copy step time |", "| ---: | --- | ---: |"]
    for r in summary["reduce_ratios"]:
        out.append(f"| {r['world_size']} | {'on' if r['comm_fusion'] else 'off'} "
                   f"| {r['pool_vs_zero_copy_time']:.2f} |")
    return out + [""]


def write_report(results_path: Path, out_dir: Optional[Path] = None) -> list[Path]:
    """``<stem>.md`` (and ``<stem>-copy-overhead.png`` when there are copy results) in
    ``out_dir`` (default: beside the JSON). Returns the paths written."""
    from benchmarks.chart import plot_copy_overhead
    results_path = Path(results_path)
    results = json.loads(results_path.read_text(encoding="utf-8"))
    out_dir = Path(out_dir) if out_dir is not None else results_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    chart = out_dir / f"{results_path.stem}-copy-overhead.png"
    if plot_copy_overhead(results, chart):
        written.append(chart)
    md = out_dir / f"{results_path.stem}.md"
    md.write_text(markdown(results, chart.name if written else None), encoding="utf-8")
    return [md] + written


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
