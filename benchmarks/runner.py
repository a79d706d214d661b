"""``python -m benchmarks run``: time the copy-in cases and the reduce step, write one JSON.

    python -m benchmarks run --device CPU --nproc 2 --out results.json [--quick]

Where each suite runs:

* started normally: ``copy`` and ``reduce-local`` (world size 1, SingleProcessCommunicator) run in
  this process; with ``--nproc N > 1`` the runner then starts itself on N ranks under msrun
  (``gradpool.launch.run_ranks``) for ``reduce-dist`` and ``reduce-profile`` only (the fused
  step's phases per rank, :mod:`benchmarks.phase_profile`), so the copy timings never share the
  machine with other ranks; rank 0 hands its rows back in its rank report, and every rank its
  profile (:mod:`gradpool.app.rank_report`).
* started by msrun (``gradpool.comm.launched_by_msrun()``; e.g. ``msrun --worker_num=8 ...
  python -m benchmarks run --device Ascend --nproc 8 --out r.json`` on Ascend 910B): every rank
  runs every suite asked for on its own device (``reduce-dist`` over HCCL or MCCL through
  ``communicator_for``) and rank 0 writes the JSON.

The JSON holds the machine (CPU model, cores, MindSpore / NumPy versions, device), the command,
the raw timings and the derived ratios (:func:`benchmarks.report.summarize`).
"""
from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from benchmarks.cases import BenchmarkError
from gradpool.device import SUPPORTED_DEVICES

logger = logging.getLogger(__name__)

SUITES = ("copy", "reduce-local", "reduce-dist", "reduce-profile")
SCHEMA = 2            # 2: every timing has rounds/median/IQR/stddev/min/max; git commit, versions
BENCH_EXTRA_HINT = "pip install -e .[bench]"


@dataclass(frozen=True)
class RunOptions:
    device: str = "CPU"
    nproc: int = 1
    out: Path = Path("bench-results.json")
    quick: bool = False
    suites: tuple = SUITES
    progress: bool = True
    timeout: float = 3600.0
    command: Optional[str] = None       # recorded in the JSON; defaults to this process's argv

    def __post_init__(self):
        if self.device not in SUPPORTED_DEVICES:
            raise BenchmarkError(f"device must be 'CPU' or 'Ascend', got {self.device!r}")
        if not isinstance(self.nproc, int) or self.nproc < 1:
            raise BenchmarkError(f"nproc must be an integer >= 1, got {self.nproc!r}")
        unknown = set(self.suites) - set(SUITES)
        if unknown or not self.suites:
            raise BenchmarkError(f"suites must be a non-empty subset of {', '.join(SUITES)}; "
                                 f"got {', '.join(self.suites) or 'none'}")

    @property
    def settings(self):
        from benchmarks.suites import FULL, QUICK
        return QUICK if self.quick else FULL


def run(options: RunOptions) -> Optional[dict]:
    """Run the suites; returns the results written to ``options.out`` (None on ranks > 0)."""
    import mindspore as ms
    from gradpool.comm import launched_by_msrun

    ms.set_device(options.device)
    if launched_by_msrun():
        return _run_as_rank(options)
    results = _new_results(options, world_size=1)
    _run_local_suites(results, options)
    if set(_RANK_SUITES) & set(options.suites) and options.nproc > 1:
        ranks = _launch_ranks(options)
        results["reduce"] += ranks["reduce"]
        results["reduce_profile"] = ranks["reduce_profile"]
    _finish(results, options.out)
    return results


# -- in this process -------------------------------------------------------------------------
def _run_local_suites(results: dict, options: RunOptions, show: bool = True) -> None:
    from benchmarks.suites import run_copy_suite, run_reduce_suite
    from gradpool.comm import SingleProcessCommunicator

    show = show and options.progress
    if "copy" in options.suites:
        results["copy"] = run_copy_suite(options.settings, show)
    if "reduce-local" in options.suites:
        results["reduce"] += run_reduce_suite(SingleProcessCommunicator(), options.settings, show)


_RANK_SUITES = ("reduce-dist", "reduce-profile")      # what the msrun ranks run


def _launch_ranks(options: RunOptions) -> dict:
    """Run the distributed suites of ``options.suites`` on ``options.nproc`` ranks under msrun:
    ``{"reduce": rank 0's reduce rows, "reduce_profile": every rank's phase profile}``, read
    from their rank reports (``_run_as_rank`` publishes them there)."""
    from gradpool.app import rank_report
    from gradpool.app.errors import LaunchError
    from gradpool.app.launch import run_ranks

    work = Path(tempfile.mkdtemp(prefix="gradpool-bench-"))
    wanted = [suite for suite in _RANK_SUITES if suite in options.suites]
    args = ["run", "--device", options.device, "--nproc", str(options.nproc),
            "--suites", ",".join(wanted), "--no-progress"] + (["--quick"] if options.quick else [])
    logger.info("starting %d ranks under msrun (logs in %s)", options.nproc, work)
    try:
        run_ranks(Path(__file__).with_name("__main__.py"), args, nproc=options.nproc,
                  log_dir=work, timeout=options.timeout)
    except LaunchError as exc:
        raise BenchmarkError(f"the {options.nproc}-rank reduce suite failed: {exc}") from None
    reports = [rank_report.read_report(work, rank) for rank in range(options.nproc)]
    if reports[0] is None or "reduce" not in reports[0].results:
        raise BenchmarkError(f"rank 0 reported no reduce rows "
                             f"({rank_report.report_path(work, 0)})")
    profiles = []
    if "reduce-profile" in wanted:
        for rank, report in enumerate(reports):
            if report is None or "reduce_profile" not in report.results:
                raise BenchmarkError(f"rank {rank} reported no reduce profile "
                                     f"({rank_report.report_path(work, rank)})")
            profiles.append(report.results["reduce_profile"])
    return {"reduce": reports[0].results["reduce"], "reduce_profile": profiles}


# -- as one of msrun's ranks -------------------------------------------------------------------
def _run_as_rank(options: RunOptions) -> Optional[dict]:
    from benchmarks.phase_profile import profile_fused_step
    from benchmarks.suites import run_reduce_suite
    from gradpool.app import rank_report
    from gradpool.comm import communicator_for, init_distributed
    from gradpool.device import block_launches, blocks_launches_by_default

    rank, world = init_distributed()     # msrun's scheduler process never returns from this
    if world != options.nproc:
        logger.warning("--nproc %d ignored: msrun started %d ranks", options.nproc, world)
    results = _new_results(options, world_size=world)
    results["machine"]["copy_suite_concurrent_ranks"] = world if "copy" in options.suites else 0
    _run_local_suites(results, options, show=rank == 0)
    if set(_RANK_SUITES) & set(options.suites) and world > 1:
        if blocks_launches_by_default(options.device):
            # As `gradpool train` runs CPU ranks (launch.launch_blocking's default): with PyNative's
            # async queues, 2 ranks on 2 cores spend most of a step handing ops between threads,
            # and the spread of the step (IQR 4-6 ms on 12 ms) hides the pool's cost. After the
            # local suites, which keep MindSpore's default; each row records the mode.
            block_launches()
        comm = communicator_for(options.device)
        if "reduce-dist" in options.suites:
            results["reduce"] += run_reduce_suite(comm, options.settings,
                                                  options.progress and rank == 0)
        if "reduce-profile" in options.suites:
            # Last: its 2 x 300 lined-up steps must not change what the reduce suite measured.
            # Started by msrun itself, the JSON rank 0 writes holds rank 0's profile only.
            results["reduce_profile"] = [profile_fused_step(comm, options.settings.profile_steps)]
    # Started by _launch_ranks (gradpool.launch): the rows go back in the rank report, no file.
    reporter = rank_report.launched_reporter()
    if reporter is not None:
        reporter.publish("reduce", results["reduce"])
        if results["reduce_profile"]:
            reporter.publish("reduce_profile", results["reduce_profile"][0])
        return None
    if rank != 0:
        return None
    _finish(results, options.out)
    return results


# -- results -----------------------------------------------------------------------------------
def machine_info(device: str, world_size: int) -> dict:
    import ml_dtypes
    import mindspore as ms
    import numpy as np
    from gradpool.host import caches
    thresholds = caches.stream_thresholds()
    return {"cpu_model": _cpu_model(), "cores": os.cpu_count(), "machine": platform.machine(),
            "caches": caches.describe_caches(caches.read_caches()),
            "stream_thresholds": {"copy_from_bytes": thresholds.copy_from_bytes,
                                  "cast_from_bytes": thresholds.cast_from_bytes,
                                  "from": thresholds.source},
            "platform": platform.platform(), "python": platform.python_version(),
            "mindspore": ms.__version__, "numpy": np.__version__,
            "ml_dtypes": ml_dtypes.__version__, "pytest_benchmark": _version("pytest-benchmark"),
            "device": device, "world_size": world_size, **_git_commit()}


def _version(distribution: str) -> Optional[str]:
    from importlib import metadata
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> dict:
    """The checkout's commit and whether it had uncommitted changes (None outside a checkout)."""
    import subprocess
    root = Path(__file__).resolve().parent.parent

    def git(*args) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": bool(status) if status is not None else None}


def require_bench_extra() -> None:
    """Raise :class:`BenchmarkError` in one line naming the install command when a package of
    the ``bench`` extra is missing (statistics, progress bars, the chart)."""
    import importlib.util
    missing = [name for module, name in (("pytest_benchmark", "pytest-benchmark"),
                                         ("tqdm", "tqdm"), ("matplotlib", "matplotlib"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise BenchmarkError(f"the benchmarks need the bench extra ({', '.join(missing)} "
                             f"missing): {BENCH_EXTRA_HINT}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _new_results(options: RunOptions, world_size: int) -> dict:
    require_bench_extra()     # first thing every run does: fail in one line, not mid-sweep
    command = options.command or shlex.join(sys.argv)
    return {"schema": SCHEMA,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "machine": machine_info(options.device, world_size),
            "options": {"device": options.device, "nproc": options.nproc, "quick": options.quick,
                        "suites": list(options.suites), **options.settings.to_dict()},
            "copy": None, "reduce": [], "reduce_profile": []}


def _finish(results: dict, out: Path) -> None:
    from benchmarks.report import summarize
    results["summary"] = summarize(results)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results, indent=2), encoding="utf-8")
    tmp.replace(out)
    logger.info("wrote %s", out)


# -- CLI ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="CPU", choices=SUPPORTED_DEVICES)
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks of the distributed reduce suite (msrun); 1: none")
    parser.add_argument("--out", default="bench-results.json", help="results JSON")
    parser.add_argument("--quick", action="store_true", help="small sweep (smoke run)")
    parser.add_argument("--suites", default=",".join(SUITES),
                        help=f"comma-separated subset of {','.join(SUITES)} (default: all)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bars")
    parser.add_argument("--timeout", type=float, default=3600.0,
                        help="seconds the msrun launch may take")


def options_from(args: argparse.Namespace, command: Optional[str] = None) -> RunOptions:
    suites = tuple(s.strip() for s in args.suites.split(",") if s.strip())
    return RunOptions(device=args.device, nproc=args.nproc, out=Path(args.out), quick=args.quick,
                      suites=suites, progress=args.progress, timeout=args.timeout,
                      command=command)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks run",
                                     description="Copy-in and reduce-step benchmarks.")
    add_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        results = run(options_from(args, "python -m benchmarks run " + shlex.join(argv)))
    except BenchmarkError as exc:
        print(f"benchmarks: FAILED: {exc}", file=sys.stderr)
        return 1
    if results is not None:
        print(f"wrote {args.out}")
    return 0
