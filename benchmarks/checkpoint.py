"""Checkpoint saves and loads per rank: the time the training loop is blocked per save,
synchronous against asynchronous (``save(..., async_save=True)``), the write throughput and
where a save's time goes; the tiny DeepSeek-V3 model and a 1 GiB dense stack (16 layers of
4096 x 4096 float32, 512 MiB per rank), each under ``fully_shard`` on ``--world`` msrun ranks.
Both modes run in turn in one process per rank (``benchmarks/checkpoint_worker.py``), medians
of ``--repeats``; every phase starts at a barrier.

Blocked: a synchronous save's whole time (barriers, checksums, write, fsyncs, rank 0's index);
an asynchronous save's call (prepare barriers and the copy of the state to host memory) plus
its wait (the commit: barriers, rank 0's index, the removal of the generation it superseded).
Write GB/s: the bytes this rank wrote over its checksums, write and fsync alone. Loads read
files the saves just wrote, so they come from the page cache, not the disk.

    python -m benchmarks.checkpoint [--world 2] [--repeats 3] [--quick] [--out FILE.md]
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

WORKER = Path(__file__).with_name("checkpoint_worker.py")
MODELS = {"tiny": "tiny DeepSeek-V3 (defaults)", "stack": "dense stack"}
PHASE_NAMES = {"snapshot": "copy to host", "checksum": "xxh3 checksums",
               "save_file": "safetensors save_file (into the page cache)",
               "fsync_rename": "fsync + rename", "index": "rank 0's index",
               "remove_superseded": "removing the superseded generation"}


def run_model(model: str, world: int, repeats: int, stack: tuple, work: Path,
              work_seconds: float) -> list[dict]:
    from gradpool.app.launch import run_ranks
    from gradpool.app.rank_report import read_reports
    out = work / f"{model}-reports"
    args = [str(out), str(work / "checkpoints"), "--model", model, "--repeats", str(repeats),
            "--layers", str(stack[0]), "--hidden", str(stack[1]),
            "--work-seconds", str(work_seconds)]
    run_ranks(WORKER, args, nproc=world, log_dir=out / "logs", report_dir=out, timeout=1800)
    return [report.results["runs"][model] for report in read_reports(out, world)]


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _git() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                               text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def report_lines(rows: dict, world: int, repeats: int, stack: tuple,
                 work_seconds: float) -> list[str]:
    layers, hidden = stack
    lines = [f"# Checkpoint save and load ({world} msrun CPU ranks, {os.cpu_count()} cores, "
             f"{platform.machine()})", "",
             f"Git `{_git()}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Medians of "
             f"{repeats} repeats; synchronous and asynchronous saves in turn in one process per "
             f"rank, a {work_seconds:g} s training stand-in (MindSpore matmuls) between them; "
             f"the stack is {layers} layers of {hidden} x {hidden} float32. Reproduce: `python "
             f"-m benchmarks.checkpoint --world {world} --repeats {repeats} --layers {layers} "
             f"--hidden {hidden} --out docs/benchmarks/checkpoint.md`.", "",
             "## Time the training loop is blocked per save", "",
             "| model | rank | written MiB | sync blocked s | async blocked s (call + wait) "
             "| async / sync | stand-in alone s | during the write s |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for model, records in rows.items():
        for rank, r in enumerate(records):
            ratio = r["async_blocked"] / r["sync_blocked"] if r["sync_blocked"] else 0.0
            lines.append(
                f"| {MODELS[model]} | {rank} | {r['bytes_written'] / 2**20:.1f} | "
                f"{r['sync_blocked']:.3f} | {r['async_blocked']:.3f} ({r['async_call']:.3f} + "
                f"{r['async_wait']:.3f}) | {ratio:.2f} | {r['work_alone']:.2f} | "
                f"{r['work_during']:.2f} |")
    lines += ["", "## Write throughput and where a save's time goes", "",
              "| model | rank | mode | write s | write GB/s | "
              + " | ".join(PHASE_NAMES.values()) + " |",
              "| --- | ---: | --- | ---: | ---: | " + " | ".join("---:" for _ in PHASE_NAMES)
              + " |"]
    for model, records in rows.items():
        for rank, r in enumerate(records):
            for mode in ("sync", "async"):
                profile = r[f"{mode}_profile"]
                lines.append(
                    f"| {MODELS[model]} | {rank} | {mode} | {r[f'{mode}_write']:.3f} | "
                    f"{_gbps(r['bytes_written'], r[f'{mode}_write']):.2f} | "
                    + " | ".join(f"{profile[p]:.3f}" for p in PHASE_NAMES) + " |")
    lines += ["", "## Loads", "", "| model | rank | read MiB | load s | load GB/s |",
              "| --- | ---: | ---: | ---: | ---: |"]
    for model, records in rows.items():
        for rank, r in enumerate(records):
            lines.append(f"| {MODELS[model]} | {rank} | {r['bytes_read'] / 2**20:.1f} | "
                         f"{r['load']:.3f} | {_gbps(r['bytes_read'], r['load']):.2f} |")
    lines += ["", "Loads read from the page cache (the files were just written)."]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--work-seconds", type=float, default=3.0,
                        help="the training stand-in between saves")
    parser.add_argument("--quick", action="store_true", help="a 16 MiB stack, one repeat")
    parser.add_argument("--out", type=Path, help="write the report (markdown) here too")
    args = parser.parse_args(argv)
    stack = (4, 1024) if args.quick else (args.layers, args.hidden)
    repeats = 1 if args.quick else args.repeats
    work_seconds = 0.5 if args.quick else args.work_seconds
    with tempfile.TemporaryDirectory(prefix="gradpool-ckpt-bench-") as work:
        rows = {model: run_model(model, args.world, repeats, stack, Path(work), work_seconds)
                for model in MODELS}
    lines = report_lines(rows, args.world, repeats, stack, work_seconds)
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
