"""The launching side of ``gradpool train``: start the ranks, follow rank 0, collect the outcome.

Usage::

    result = run_job(cfg, on_step=print)         # raises TrainJobError when a rank failed
    result.records                               # rank 0's StepRecords
    comparison = compare_with_reference(cfg, result.records)

Files (in ``cfg.launch.log_dir``, or a new temporary directory): ``config.yaml`` (the resolved
config every rank loads), the rank reports ``rank<R>.report.json`` (:mod:`gradpool.app.rank_report`;
:mod:`gradpool.app.rank_main` publishes its step records and outcome there), and msrun's
``worker_<R>.log``, ``scheduler.log``, ``msrun.log``.

``launch.ranks == 1`` runs in this process (no msrun, no communication); more ranks run under
msrun, one process per rank.
"""
from __future__ import annotations

import logging
import math
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from gradpool.app import rank_main, rank_report
from gradpool.app.train import StepRecord, train_reference
from gradpool.app.config import RunConfig, dump_yaml
from gradpool.errors import GradPoolError, LaunchError

logger = logging.getLogger(__name__)

StepCallback = Callable[[StepRecord], None]


class TrainJobError(GradPoolError, RuntimeError):
    """A training job failed. ``reason`` is one line (which rank, which error); ``details`` holds
    what else is known (the launcher's message with the failing ranks' log tails)."""

    def __init__(self, reason: str, details: str = ""):
        super().__init__(reason if not details else f"{reason}\n{details}")
        self.reason = reason
        self.details = details


@dataclass(frozen=True)
class JobResult:
    records: list          # rank 0's StepRecords, in step order
    outcome: rank_main.RankOutcome   # rank 0's final outcome (pool statistics, verification)
    log_dir: Path
    seconds: float


@dataclass(frozen=True)
class ReferenceComparison:
    """Sharded (rank 0's mean-over-ranks) losses against the single-process unsharded model."""

    sharded_losses: tuple
    reference_losses: tuple
    max_abs_diff: float
    max_rel_diff: float

    def within(self, rtol: float) -> bool:
        return self.max_rel_diff <= rtol


def prepare_log_dir(cfg: RunConfig) -> Path:
    """The run's log directory with the resolved config in it, stale rank files removed."""
    log_dir = Path(cfg.launch.log_dir) if cfg.launch.log_dir else Path(
        tempfile.mkdtemp(prefix="gradpool-train-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    rank_report.remove_reports(log_dir)          # a reused log_dir must not show an old run
    (log_dir / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
    return log_dir


def set_device(device: str) -> None:
    """Point this process's MindSpore at ``device`` (the in-process rank and the reference)."""
    import mindspore as ms
    ms.set_device(device)


def run_job(cfg: RunConfig, on_step: Optional[StepCallback] = None,
            timeout: float = 3600) -> JobResult:
    """Train ``cfg`` on ``cfg.launch.ranks`` ranks; ``on_step`` sees rank 0's records as they come.

    Raises :class:`TrainJobError` when a rank fails (its outcome or log names the reason)."""
    log_dir = prepare_log_dir(cfg)
    start = time.monotonic()
    if cfg.launch.ranks == 1:
        set_device(cfg.launch.device)
        rank_main.run_rank(cfg, log_dir, on_step=on_step)
    else:
        _run_under_msrun(cfg, log_dir, on_step, timeout)
    seconds = time.monotonic() - start
    outcomes = read_outcomes(log_dir, cfg.launch.ranks)
    failed = [o for o in outcomes if o is not None and not o.ok]
    if failed:
        raise TrainJobError(_reason(failed), f"logs in {log_dir}")
    if outcomes[0] is None:
        raise TrainJobError(f"rank 0 wrote no outcome ({rank_report.report_path(log_dir, 0)})",
                            f"logs in {log_dir}")
    return JobResult(records=read_records(log_dir, 0),
                     outcome=outcomes[0], log_dir=log_dir, seconds=seconds)


def _run_under_msrun(cfg: RunConfig, log_dir: Path, on_step: Optional[StepCallback],
                     timeout: float) -> None:
    from gradpool.app.launch import run_ranks

    follower = _RecordFollower(log_dir, 0, on_step) if on_step else None
    if follower is not None:
        follower.start()
    try:
        run_ranks(rank_main.__file__, ["--config", str(log_dir / "config.yaml"),
                                       "--out-dir", str(log_dir)],
                  nproc=cfg.launch.ranks, log_dir=log_dir, timeout=timeout,
                  master_port=cfg.launch.master_port)
    except LaunchError as exc:
        failed = [o for o in read_outcomes(log_dir, cfg.launch.ranks)
                  if o is not None and not o.ok]
        reason = _reason(failed) if failed else str(exc).split("\n", 1)[0]
        raise TrainJobError(reason, str(exc)) from None
    finally:
        if follower is not None:
            follower.stop()


def _reason(failed: list) -> str:
    """One line: the first failing rank's error, and which other ranks failed."""
    first = failed[0]
    others = [o.rank for o in failed[1:]]
    suffix = f" (also failed: rank {', '.join(map(str, others))})" if others else ""
    return first.describe_error() + suffix


def read_records(log_dir: Path, rank: int = 0) -> list:
    """The :class:`StepRecord` s rank ``rank`` has published so far, in step order."""
    report = rank_report.read_report(log_dir, rank)
    steps = report.results.get(rank_main.STEPS, []) if report is not None else []
    return [StepRecord(**step) for step in steps]


def read_outcomes(log_dir: Path, ranks: int) -> list:
    """Each rank's :class:`RankOutcome`, or None where the rank published none (it crashed)."""
    out = []
    for report in rank_report.read_reports(log_dir, ranks):
        outcome = report.results.get(rank_main.OUTCOME) if report is not None else None
        out.append(rank_main.RankOutcome.from_dict(outcome) if outcome is not None else None)
    return out


def compare_with_reference(cfg: RunConfig, records: list) -> ReferenceComparison:
    """Train the unsharded model in this process on the same global batches; compare losses."""
    set_device(cfg.launch.device)
    reference, _ = train_reference(cfg, world=cfg.launch.ranks)
    sharded = [r.loss for r in records]
    diffs = [abs(s - r) for s, r in zip(sharded, reference)]
    rel = [d / abs(r) if r else (0.0 if d == 0 else math.inf) for d, r in zip(diffs, reference)]
    return ReferenceComparison(tuple(sharded), tuple(reference), max(diffs, default=0.0),
                               max(rel, default=0.0))


class _RecordFollower:
    """Calls ``callback`` for each step record a rank publishes in its report, from a thread that
    polls the report (it is rewritten whole, atomically, after every step)."""

    POLL_SECONDS = 0.2

    def __init__(self, log_dir: Path, rank: int, callback: StepCallback):
        self._log_dir, self._rank = log_dir, rank
        self._callback = callback
        self._seen = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="gradpool-record-follower",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stopped.wait(self.POLL_SECONDS):
            self._drain()
        self._drain()      # whatever was published between the last poll and stop()

    def _drain(self) -> None:
        try:
            records = read_records(self._log_dir, self._rank)
        except GradPoolError:
            logger.exception("cannot read rank %d's report", self._rank)
            return
        for record in records[self._seen:]:
            self._seen += 1
            try:
                self._callback(record)
            except Exception:  # noqa: BLE001 - a printing callback must not kill the run
                logger.exception("step callback failed on %r", record)
