"""The launching side of ``gradpool train``: start this node's ranks, follow rank 0, collect.

Usage::

    log_dir = prepare_log_dir(cfg)               # print it before anything starts
    result = run_job(cfg, on_step=print, log_dir=log_dir)   # TrainJobError when a rank failed
    result.records                               # the job's steps (node 0)
    comparison = compare_with_reference(cfg, result.records)

Files (in ``cfg.launch.log_dir``, or a new temporary directory; with ``launch.nodes > 1`` in its
``node<k>/`` subdirectory, so nodes sharing a filesystem never write each other's files):
``config.yaml`` (the resolved config every rank of the node loads), the rank reports
``rank<R>.report.json`` (:mod:`gradpool.app.rank_report`; :mod:`gradpool.app.rank_main`
publishes its step records and outcome there), and msrun's ``worker_<R>.log``,
``scheduler.log``, ``msrun.log``.

Node 0 hosts rank 0, which learns every rank's step counters and outcome through the job's own
communicator (``rank_main.exchange``), so node 0 shows the whole job without reading any other
node's files. On a shared filesystem the launcher also watches the other nodes' reports (read
only) and stops this node's ranks when a rank elsewhere has failed.

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
from gradpool.errors import GradPoolError
from gradpool.app.errors import LaunchError

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
    records: list          # the job's steps as StepRecords (JobStep.record), node 0; else []
    outcome: rank_main.RankOutcome   # rank 0's final outcome on node 0, else this node's first
    log_dir: Path          # this node's directory
    seconds: float
    job: Optional[dict] = None       # rank 0's view of every rank's outcome (node 0)
    outcomes: tuple = ()             # this node's ranks' outcomes
    node_rank: int = 0


@dataclass(frozen=True)
class JobStep:
    """One step of the whole job: the mean loss and every rank's counters (rank 0's report)."""

    step: int
    loss: float
    ranks: tuple           # one dict of rank_main.STEP_FIELDS per rank
    saved: Optional[dict] = None     # the checkpoint saved after this step, rank 0's view

    def record(self) -> StepRecord:
        """The step as one line shows it: the slowest rank's time, the largest bytes copied,
        high-water and stall, the slowest copy rate, and new allocations summed over ranks."""
        ranks = self.ranks
        return StepRecord(step=self.step, loss=self.loss,
                          seconds=max(r["seconds"] for r in ranks),
                          bytes_copied=max(r["bytes_copied"] for r in ranks),
                          copy_gbps=min(r["copy_gbps"] for r in ranks),
                          new_allocations=sum(r["new_allocations"] for r in ranks),
                          high_water_bytes=max(r["high_water_bytes"] for r in ranks),
                          stall_seconds=max(r["stall_seconds"] for r in ranks),
                          stalls=max(r["stalls"] for r in ranks), saved=self.saved)


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
    """This node's log directory with the resolved config in it, its stale rank files removed
    (``launch.log_dir``, or a new temporary one; ``node<k>/`` in it when there are several
    nodes: only this node's own files are ever written or removed)."""
    base = Path(cfg.launch.log_dir) if cfg.launch.log_dir else Path(
        tempfile.mkdtemp(prefix="gradpool-train-"))
    log_dir = node_dir(base, cfg.launch.node_rank) if cfg.launch.nodes > 1 else base
    log_dir.mkdir(parents=True, exist_ok=True)
    rank_report.remove_reports(log_dir)          # a reused log_dir must not show an old run
    (log_dir / "config.yaml").write_text(dump_yaml(cfg), encoding="utf-8")
    return log_dir


def node_dir(base, node: int) -> Path:
    return Path(base) / f"node{node}"


def run_job(cfg: RunConfig, on_step: Optional[StepCallback] = None,
            timeout: float = 3600, log_dir=None) -> JobResult:
    """Run this node's ranks of ``cfg`` (all of them with one node); ``on_step`` sees the job's
    steps as they end (on node 0: rank 0 reports every rank's). ``log_dir``: from
    :func:`prepare_log_dir` (made here when None).

    Raises :class:`TrainJobError` when a rank fails (its outcome or log names the reason)."""
    log_dir = Path(log_dir) if log_dir is not None else prepare_log_dir(cfg)
    launch = cfg.launch
    local = range(launch.first_rank, launch.first_rank + launch.local_ranks)
    start = time.monotonic()
    if launch.ranks == 1:
        rank_main.prepare_process(launch)
        rank_main.run_rank(cfg, log_dir, on_step=on_step)
    else:
        _run_under_msrun(cfg, log_dir, on_step, timeout)
    seconds = time.monotonic() - start
    outcomes = read_outcomes(log_dir, local)
    failed = [o for o in outcomes if o is not None and not o.ok]
    if failed:
        raise TrainJobError(_reason(failed, cfg), f"logs in {log_dir}")
    missing = [rank for rank, o in zip(local, outcomes) if o is None]
    if missing:
        raise TrainJobError(f"rank {missing[0]} wrote no outcome "
                            f"({rank_report.report_path(log_dir, missing[0])})",
                            f"logs in {log_dir}")
    if launch.node_rank != 0:
        return JobResult(records=[], outcome=outcomes[0], log_dir=log_dir, seconds=seconds,
                         outcomes=tuple(outcomes), node_rank=launch.node_rank)
    report = rank_report.read_report(log_dir, 0)
    return JobResult(records=read_job_records(log_dir), outcome=outcomes[0], log_dir=log_dir,
                     seconds=seconds, job=report.results.get(rank_main.JOB),
                     outcomes=tuple(outcomes), node_rank=0)


def node_launch(cfg: RunConfig, log_dir: Path, master_is_local: Optional[bool] = None):
    """What this node starts for ``cfg`` (:func:`gradpool.app.launch.build_node_launch`)."""
    from gradpool.app.launch import NodeSpec, build_node_launch, free_port

    launch = cfg.launch
    spec = NodeSpec(world=launch.ranks, local=launch.local_ranks, node_rank=launch.node_rank,
                    nodes=launch.nodes, master_addr=launch.master_addr,
                    master_port=launch.master_port or free_port(),
                    cluster_timeout_s=launch.cluster_timeout_s)
    args = ["--config", str(log_dir / "config.yaml"), "--out-dir", str(log_dir)]
    return build_node_launch(spec, rank_main.__file__, args, log_dir=log_dir,
                             env=launch.rank_env(), master_is_local=master_is_local)


def _run_under_msrun(cfg: RunConfig, log_dir: Path, on_step: Optional[StepCallback],
                     timeout: float) -> None:
    from gradpool.app.launch import run_node

    launch = cfg.launch
    follower = _RecordFollower(log_dir, 0, on_step, read=read_job_records) \
        if on_step and launch.node_rank == 0 else None
    peers = {}
    if launch.nodes > 1 and launch.log_dir:       # maybe a shared filesystem: watch, read only
        peers = {k: node_dir(launch.log_dir, k) for k in range(launch.nodes)
                 if k != launch.node_rank}
    if follower is not None:
        follower.start()
    try:
        run_node(node_launch(cfg, log_dir), timeout=timeout, peer_dirs=peers,
                 stop_save_grace=cfg.train.stop_save_grace_s)
    except LaunchError as exc:
        local = range(launch.first_rank, launch.first_rank + launch.local_ranks)
        failed = [o for o in read_outcomes(log_dir, local) if o is not None and not o.ok]
        reason = _reason(failed, cfg) if failed else str(exc).split("\n", 1)[0]
        raise TrainJobError(reason, str(exc)) from None
    finally:
        if follower is not None:
            follower.stop()


def _reason(failed: list, cfg: Optional[RunConfig] = None) -> str:
    """One line: the first failing rank's error, and which other ranks failed."""
    first = failed[0]
    others = [o.rank for o in failed[1:]]
    suffix = f" (also failed: rank {', '.join(map(str, others))})" if others else ""
    where = ""
    if cfg is not None and cfg.launch.nodes > 1:
        where = f" (node {cfg.launch.node_of(first.rank)} of {cfg.launch.nodes})"
    return first.describe_error() + where + suffix


def read_records(log_dir: Path, rank: int = 0) -> list:
    """The :class:`StepRecord` s rank ``rank`` has published so far, in step order."""
    report = rank_report.read_report(log_dir, rank)
    steps = report.results.get(rank_main.STEPS, []) if report is not None else []
    return [StepRecord(**step) for step in steps]


def read_job_steps(log_dir: Path) -> list:
    """The :class:`JobStep` s rank 0 has published so far (every rank's counters), in order."""
    report = rank_report.read_report(log_dir, 0)
    return [JobStep(step=e["step"], loss=e["loss"], ranks=tuple(e["ranks"]),
                    saved=e.get("saved")) for e in rank_main.read_job_steps(report)]


def read_job_records(log_dir: Path, rank: int = 0) -> list:
    """The job's steps as :class:`StepRecord` s (see :meth:`JobStep.record`)."""
    return [step.record() for step in read_job_steps(log_dir)]


def read_outcomes(log_dir: Path, ranks) -> list:
    """Each rank's :class:`RankOutcome`, or None where the rank published none (it crashed).
    ``ranks``: a count (ranks 0 to N-1) or the ranks themselves (one node's)."""
    ranks = range(ranks) if isinstance(ranks, int) else ranks
    out = []
    for report in rank_report.read_ranks(log_dir, ranks):
        outcome = report.results.get(rank_main.OUTCOME) if report is not None else None
        out.append(rank_main.RankOutcome.from_dict(outcome) if outcome is not None else None)
    return out


def compare_with_reference(cfg: RunConfig, records: list) -> ReferenceComparison:
    """Train the unsharded model in this process on the same global batches; compare losses."""
    rank_main.prepare_process(cfg.launch)
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

    def __init__(self, log_dir: Path, rank: int, callback: StepCallback,
                 read: Callable = None):
        self._log_dir, self._rank = log_dir, rank
        self._callback = callback
        self._read = read or read_records
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
            records = self._read(self._log_dir, self._rank)
        except GradPoolError:
            logger.exception("cannot read rank %d's report", self._rank)
            return
        for record in records[self._seen:]:
            self._seen += 1
            try:
                self._callback(record)
            except Exception:  # noqa: BLE001 - a printing callback must not kill the run
                logger.exception("step callback failed on %r", record)
