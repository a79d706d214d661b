"""Checkpoint save and load seconds and GB/s per rank: the tiny DeepSeek-V3 model and a 1 GiB
dense stack (16 layers of 4096 x 4096 float32), each under ``fully_shard`` on ``--world`` msrun
ranks, saved and loaded ``--repeats`` times (medians; every repeat starts at a barrier).

GB/s per rank is the bytes that rank wrote (or read) over the time of the whole save (or load):
a save's time includes its three barriers, the fsyncs and rank 0's index. Loads read files the
saves just wrote, so they come from the page cache, not the disk.

    python -m benchmarks.checkpoint [--world 2] [--repeats 3] [--quick] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import tempfile
from pathlib import Path

WORKER = Path(__file__).with_name("checkpoint_worker.py")
MODELS = {"tiny": "tiny DeepSeek-V3 (defaults)", "stack": "dense stack"}


def run_model(model: str, world: int, repeats: int, stack: tuple, work: Path) -> list[dict]:
    from gradpool.app.launch import run_ranks
    from gradpool.app.rank_report import read_reports
    out = work / f"{model}-reports"
    args = [str(out), str(work / "checkpoints"), "--model", model, "--repeats", str(repeats),
            "--layers", str(stack[0]), "--hidden", str(stack[1])]
    run_ranks(WORKER, args, nproc=world, log_dir=out / "logs", report_dir=out, timeout=1800)
    return [report.results["runs"][model] for report in read_reports(out, world)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def report_lines(rows: dict, world: int, repeats: int, stack: tuple) -> list[str]:
    layers, hidden = stack
    lines = [f"# Checkpoint save and load ({world} msrun CPU ranks, {os.cpu_count()} cores, "
             f"{platform.machine()})", "",
             f"Medians of {repeats} saves and {repeats} loads; the stack is {layers} layers of "
             f"{hidden} x {hidden} float32. Reproduce: `python -m benchmarks.checkpoint "
             f"--world {world} --repeats {repeats} --layers {layers} --hidden {hidden} "
             "--out docs/benchmarks/checkpoint.md`.", "",
             "| model | rank | written MiB | save s | save GB/s | read MiB | load s | load GB/s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, records in rows.items():
        for rank, r in enumerate(records):
            lines.append(
                f"| {MODELS[model]} | {rank} | {r['bytes_written'] / 2**20:.1f} | "
                f"{r['save_seconds']:.3f} | {_gbps(r['bytes_written'], r['save_seconds']):.2f} | "
                f"{r['bytes_read'] / 2**20:.1f} | {r['load_seconds']:.3f} | "
                f"{_gbps(r['bytes_read'], r['load_seconds']):.2f} |")
    lines += ["", "Loads read from the page cache (the files were just written); a save's time "
              "includes its barriers, fsyncs and the index."]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="a 16 MiB stack, one repeat")
    parser.add_argument("--out", type=Path, help="write the report (markdown) here too")
    args = parser.parse_args(argv)
    stack = (4, 1024) if args.quick else (args.layers, args.hidden)
    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="gradpool-ckpt-bench-") as work:
        rows = {model: run_model(model, args.world, repeats, stack, Path(work))
                for model in MODELS}
    lines = report_lines(rows, args.world, repeats, stack)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
