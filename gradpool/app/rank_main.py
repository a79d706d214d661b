"""What every rank of ``gradpool train`` runs: train the sharded model, write what happened.

msrun starts it (through ``gradpool.launch.run_ranks``) as ::

    python -m gradpool.app._rank_entry .../gradpool/app/rank_main.py \\
        --config LOG_DIR/config.yaml --out-dir LOG_DIR

(or ``python -m gradpool.app.rank_main ...``). The config is the launcher's resolved YAML, so every
rank trains exactly what the launcher printed. Each rank publishes into its rank report
(:mod:`gradpool.app.rank_report`; the launcher's under msrun, else one in ``--out-dir``):

* ``results["steps"]``: the :class:`~gradpool.app.train.StepRecord` dicts so far, republished as
  each step ends (the launcher polls rank 0's report to print steps while the run is going);
* ``results["outcome"]``: a :class:`RankOutcome`: status, error (type and message) if the run
  failed, the pool's final statistics and how many gradients were verified intact;
* on rank 0 only, the whole job as rank 0 learns it from the other ranks through one small
  all-reduce per step (so node 0 can show every node's ranks without a shared filesystem):
  ``results["job_steps"]`` (one entry per step: the mean loss and each rank's time and pool
  counters) and, once every rank has finished, ``results["job"]`` (each rank's outcome and pool
  statistics).

With ``train.resume_from`` every rank loads the checkpoint before its first step and the outcome's
``resumed`` says what was read (rank 0's also by the whole job); with ``train.save_dir`` every
rank saves when :func:`gradpool.app.checkpoints.save_due` says so, after the step's record is
complete and before it is published, so the step's record (``saved``) and rank 0's ``job_steps``
entry name the checkpoint (:mod:`gradpool.app.checkpoints`). With ``train.async_save`` the step's
exchange also carries whether each rank's background write has finished; the first step after
every rank's has commits the save (its record names it). A rank publishes the save it has
started and not committed (``save_in_flight``), which a stop signal lets commit first.

Every rank also prints one line per step into its own log (msrun's ``worker_<rank>.log``), as
mindformers does: ``step 3/5 loss 4.537 time 912.4 ms lr 1.000e-03 ...``.

A cluster that does not form (a node that never came up, within ``launch.cluster_timeout_s``) is
recorded as a ``ClusterFormationError`` outcome naming the timeout, not as MindSpore's traceback.

A failure the run itself detects (a non-finite loss, a gradient the reduce path received that was
changed or freed: :class:`~gradpool.errors.GradientIntegrityError`) or any other exception is
recorded in the outcome, printed to stderr (so it is in the rank's log tail) and turns into exit
code 1. ``_rank_entry`` puts this file's directory first on ``sys.path``; nothing here has a
stdlib name, so that is harmless.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import mindspore as ms


from gradpool.app import checkpoints, rank_report
from gradpool.app.train import (NonFiniteLossError, build_sharded_model, optimizer_for,
                                train_sharded)
from gradpool.comm import init_distributed
from gradpool.app.config import LaunchConfig, RunConfig, load_config
from gradpool.device import block_launches, launches_blocking
from gradpool.exchange import exchange_values
from gradpool.errors import (CheckpointError, GradientIntegrityError, GradPoolError,
                             InvalidArgumentError, StateMismatchError)
from gradpool.app.errors import ConfigError
from gradpool.runtime import runtime_for

logger = logging.getLogger(__name__)

STATUS_OK, STATUS_FAILED = "ok", "failed"
STEPS, OUTCOME = "steps", "outcome"      # the keys of this program's rank report results
JOB_STEPS, JOB = "job_steps", "job"      # rank 0 only: every rank's step counters, outcomes
# What each rank tells rank 0 per step, and once at the end ("int" values travel exactly).
STEP_FIELDS = (("seconds", float), ("bytes_copied", int), ("copy_gbps", float),
               ("new_allocations", int), ("high_water_bytes", int), ("stall_seconds", float),
               ("stalls", int))
# the per-step exchange: the step's counters, and whether this rank's background write of a
# pending save has finished (checkpoints.StepSaver.written)
SYNC_FIELDS = STEP_FIELDS + (("save_written", int),)
OUTCOME_FIELDS = (("ok", int), ("steps", int), ("verified_gradients", int),
                  ("launch_blocking", int), ("new_allocations", int), ("reuses", int),
                  ("bytes_reserved", int), ("high_water_bytes", int), ("bytes_copied", int),
                  ("copy_seconds", float), ("stall_seconds", float), ("stalls", int),
                  ("padding_bytes", int))
LOAD_FIELDS = (("step", int), ("bytes_read", int), ("seconds", float))   # each rank's resume


class ClusterFormationError(GradPoolError, RuntimeError):
    """MindSpore's cluster did not form: not every rank reached the scheduler in time."""


@dataclass
class RankOutcome:
    """How one rank's training ended (``results["outcome"]`` of its rank report)."""

    rank: int
    world_size: int
    status: str = STATUS_OK
    steps: int = 0                      # steps this run completed (a resumed run: after k)
    error_type: Optional[str] = None
    error_message: Optional[str] = None
    verify_gradients: bool = False
    verified_gradients: int = 0         # gradients checksummed intact after their reduce path
    launch_blocking: bool = False       # ops ran synchronously (read from MindSpore, not the config)
    pool: dict = field(default_factory=dict)   # gradpool.pool.PoolStats as a dict
    resumed: Optional[dict] = None      # checkpoints.resume()'s dict (+ the job's, rank 0)
    saved: list = field(default_factory=list)   # checkpoints.save_step()'s dicts, in order

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    def describe_error(self) -> str:
        return f"rank {self.rank}: {self.error_type}: {self.error_message}"

    @classmethod
    def from_dict(cls, data: dict) -> "RankOutcome":
        return cls(**data)


def run_rank(cfg: RunConfig, out_dir, on_step: Optional[Callable] = None,
             log_steps: bool = False) -> RankOutcome:
    """Train this process's rank (MindSpore's device must be set already), publishing its steps
    and outcome in its rank report; ``log_steps`` prints each step's line to stdout (the rank's
    log under msrun).

    Never raises for a training failure: the returned outcome (also published) says what went
    wrong."""
    try:
        rank, world = init_distributed()
    except RuntimeError as exc:
        if os.environ.get("MS_ROLE") == "MS_SCHED":
            raise       # msrun's scheduler is no rank: its failure is msrun's to report
        return _cluster_failed(cfg, out_dir, exc)
    run = _RankRun(cfg=cfg, rank=rank, world=world,
                   reporter=rank_report.reporter_for(out_dir, rank, world),
                   outcome=RankOutcome(rank=rank, world_size=world,
                                       verify_gradients=cfg.gradpool.verify_gradients,
                                       launch_blocking=launches_blocking()),
                   log_steps=log_steps)
    try:
        _train_rank(run, on_step)
    except Exception as exc:  # noqa: BLE001 - the process boundary: record, then report
        _record_failure(run.outcome, rank, exc)
    _publish_outcome(run)
    return run.outcome


@dataclass
class _RankRun:
    """A rank's run and what it has built so far: a failure's outcome reports what exists.
    ``cfg`` is the resolved config once ``train.resume_from: latest`` is resolved."""
    cfg: RunConfig
    rank: int
    world: int
    reporter: object
    outcome: RankOutcome
    log_steps: bool
    model: object = None
    runtime: object = None


def _train_rank(run: _RankRun, on_step: Optional[Callable]) -> None:
    """Build, resume if asked, train and commit the last save; raises on any failure."""
    if run.world != run.cfg.launch.ranks:
        raise InvalidArgumentError(
            f"this process is rank {run.rank} of {run.world}, but launch.ranks = "
            f"{run.cfg.launch.ranks}; start exactly launch.ranks processes")
    run.model = build_sharded_model(run.cfg)
    run.runtime = runtime_for(run.cfg.gradpool)
    optimizer = optimizer_for(run.cfg, run.model.trainable_params())
    first_step = _resume_if_asked(run, optimizer)
    steps: list = []
    run.reporter.publish(STEPS, steps)
    saves = _RankSaves(checkpoints.StepSaver(run.cfg, run.model, optimizer, run.world,
                                             run.rank),
                       run.reporter, run.outcome, run.log_steps)
    writer = _StepWriter(run, saves, steps, first_step, on_step)
    train_sharded(run.cfg, run.model, run.runtime.comm, run.runtime.pool, on_step=writer.write,
                  optimizer=optimizer, first_step=first_step)
    saves.committed(saves.saver.finish())   # the end of the run commits a background save


def _resume_if_asked(run: _RankRun, optimizer) -> int:
    """Resolve ``latest`` and load ``train.resume_from`` if set; the step training starts at."""
    if run.cfg.train.resume_from == checkpoints.LATEST:
        run.cfg = _resolve_latest(run.cfg, run.runtime.comm, run.log_steps)
    if run.cfg.train.resume_from is None:
        return 0
    run.outcome.resumed = _resume(run.cfg, run.model, optimizer, run.runtime.comm)
    if run.log_steps:
        print(resumed_line(run.outcome.resumed), flush=True)
    return run.outcome.resumed["step"]


@dataclass
class _StepWriter:
    """After each step: record it, exchange every rank's counters, commit a finished save."""
    run: _RankRun
    saves: "_RankSaves"
    steps: list                  # the report's step records, published whole each time
    first_step: int
    on_step: Optional[Callable]

    def write(self, record) -> None:
        self._record(record)
        rows = self._exchange_and_commit(record)
        if self.run.rank == 0:
            self._publish_job_step(record, rows)
        if self.on_step is not None:
            self.on_step(record)

    def _record(self, record) -> None:
        run, saves = self.run, self.saves
        record.saved = saves.saver.after_step(record.step + 1)
        self.steps.append(dataclasses.asdict(record))
        run.reporter.publish(STEPS, self.steps)
        run.outcome.steps = record.step + 1 - self.first_step
        if run.log_steps:
            print(step_line(run.cfg, record, run.rank, run.world), flush=True)
        saves.committed(record.saved)
        saves.tell_started()

    def _exchange_and_commit(self, record) -> list:
        """Every rank's step counters (rank 0 publishes them); commits a save once every
        rank's background write of it has finished."""
        saves = self.saves
        # every rank reaches this point of every step: rank 0 learns everyone's counters,
        # and every rank whether every background write of a save has finished
        rows = exchange(self.run.runtime.comm, [getattr(record, n) for n, _ in STEP_FIELDS]
                        + [int(saves.saver.written())], SYNC_FIELDS)
        ready = saves.saver.commit_if_written(all(row[-1] for row in rows))
        if ready is not None:
            record.saved = self.steps[-1]["saved"] = ready     # at most one commit a step
            self.run.reporter.publish(STEPS, self.steps)
            saves.committed(ready)
        return [row[:-1] for row in rows]

    def _publish_job_step(self, record, rows: list) -> None:
        self.run.reporter.publish_entry(JOB_STEPS, str(record.step), {
            "step": record.step, "loss": record.loss, "saved": record.saved,
            "ranks": [dict(zip((n for n, _ in STEP_FIELDS), row)) for row in rows]})


def _record_failure(outcome: RankOutcome, rank: int, exc: Exception) -> None:
    outcome.status = STATUS_FAILED
    outcome.error_type = type(exc).__name__
    outcome.error_message = " ".join(str(exc).split()) or repr(exc)
    logger.debug("rank %d failed", rank, exc_info=True)
    if not _expected(exc):
        traceback.print_exc()


def _publish_outcome(run: _RankRun) -> None:
    outcome = run.outcome
    if run.runtime is not None:
        outcome.pool = dataclasses.asdict(run.runtime.pool.stats())
    if run.model is not None:
        outcome.verified_gradients = sum(
            getattr(getattr(p, "hsdp_param", None), "verified_gradients", 0)
            for p in run.model.trainable_params())
    run.reporter.publish(OUTCOME, dataclasses.asdict(outcome))
    if outcome.ok:
        # Published first: a rank that failed never joins this exchange, and the ranks left
        # waiting in it are stopped by the launcher; their outcome is on file already.
        _publish_job(run.cfg, run.reporter, run.runtime.comm, outcome)


class _RankSaves:
    """A rank's saves as its report and its log show them: the save in flight
    (``checkpoints.SAVE_IN_FLIGHT``, which a stop signal waits for), the last committed one
    (``checkpoints.LAST_CHECKPOINT``), the outcome's list and the log's lines."""

    def __init__(self, saver, reporter, outcome: RankOutcome, log_steps: bool):
        self.saver, self.reporter = saver, reporter
        self.outcome, self.log_steps = outcome, log_steps
        saver.announce = self._announce

    def committed(self, saved: Optional[dict]) -> None:
        """Record a committed save (None: nothing was)."""
        if saved is None:
            return
        self.outcome.saved.append(saved)
        self.reporter.publish(checkpoints.LAST_CHECKPOINT, {"path": saved["path"],
                                                             "step": saved["step"]})
        if self.saver.pending is None and self.saver.started is None:
            self.reporter.publish(checkpoints.SAVE_IN_FLIGHT, None)
        if self.log_steps:
            print(saved_line(saved), flush=True)

    def tell_started(self) -> None:
        started = self.saver.started
        if self.log_steps and started is not None:
            print(f"saving step {started['step']} to {started['path']} in the background "
                  "(train.async_save)", flush=True)

    def _announce(self, step: int, path: str) -> None:
        self.reporter.publish(checkpoints.SAVE_IN_FLIGHT, {"path": path, "step": step})


def prepare_process(launch: LaunchConfig) -> None:
    """Set up a process that trains (a rank, the in-process rank, the reference): its device, and
    blocking op launch when ``launch.blocks_launches`` (process-wide, never undone)."""
    ms.set_device(launch.device)
    if launch.blocks_launches:
        block_launches()


def step_line(cfg: RunConfig, record, rank: int, world: int) -> str:
    """One step as the rank's own log shows it (mindformers' ``step i/n loss ... lr ...``)."""
    return (f"step {record.step + 1}/{cfg.train.steps} loss {record.loss:.6f} "
            f"time {record.seconds * 1e3:.1f} ms lr {cfg.train.learning_rate:.3e} "
            f"rank {rank}/{world} copied {record.bytes_copied} B "
            f"new allocations {record.new_allocations} "
            f"pool high-water {record.high_water_bytes} B")


def saved_line(saved: dict) -> str:
    """A saved checkpoint in the rank's log (the bytes are every rank's files together), and
    the step directories ``train.keep_last`` removed after it."""
    line = (f"saved step {saved['step']} to {saved['path']} ({saved['bytes']} B, "
            f"{saved['seconds']:.2f} s{checkpoints.background_text(saved)})")
    return line + checkpoints.removed_text(saved)


def resumed_line(resumed: dict) -> str:
    return (f"resumed from {resumed['path']} at step {resumed['step']} (saved at "
            f"{resumed['world_size']} ranks; {resumed['bytes_read']} B read by this rank, "
            f"{resumed['seconds']:.2f} s)")


def _resolve_latest(cfg: RunConfig, comm, log_steps: bool) -> RunConfig:
    """``train.resume_from: latest`` resolved by the ranks themselves (a scheduler started them
    with ``gradpool launch-cmd``'s commands; ``gradpool train`` resolves it before the launch):
    every rank must find the same step, else every rank raises."""
    cfg, info, notes = checkpoints.resolve_latest(cfg)
    if log_steps and comm.rank == 0:
        for note in notes:
            print(note, flush=True)
    mine = info.step + 1 if info is not None else 0
    found = {row[0] for row in exchange(comm, [mine], (("step", int),))}
    if len(found) > 1:
        raise CheckpointError(
            f"train.resume_from = latest: the ranks found different checkpoints under "
            f"{cfg.train.save_dir} (steps {sorted(s - 1 for s in found)}; -1: none); is another "
            "run saving there? Name a step directory in train.resume_from")
    return cfg


def _resume(cfg: RunConfig, model, optimizer, comm) -> dict:
    """Load the checkpoint on every rank; the dict also holds what the job read in all
    (``job_bytes_read``) and how long the slowest rank took (``job_seconds``)."""
    resumed = checkpoints.resume(cfg, model, optimizer, comm.world_size)
    rows = exchange(comm, [resumed["step"], resumed["bytes_read"], resumed["seconds"]],
                    LOAD_FIELDS)
    steps = sorted({row[0] for row in rows})
    if len(steps) > 1:      # nodes that resolved `latest` apart while another run was saving
        raise CheckpointError(
            f"the ranks resumed from different steps {steps} (this one from {resumed['path']}); "
            "every rank must load one checkpoint: name a step directory in train.resume_from")
    rows = [row[1:] for row in rows]
    return {**resumed, "job_bytes_read": sum(row[0] for row in rows),
            "job_seconds": max(row[1] for row in rows)}


def exchange(comm, row: Sequence, fields: Sequence) -> list:
    """Every rank's ``row`` (laid out as ``fields``, the same on every rank), on every rank, by
    one all-reduce: ``int`` fields exactly (counters in bytes pass 2^24), ``float`` ones as
    float32."""
    is_int = [kind is int for _, kind in fields]
    got = exchange_values(comm, ints=[int(v) for v, i in zip(row, is_int) if i],
                          floats=[float(v) for v, i in zip(row, is_int) if not i])
    rows = []
    for ints, floats in zip(got.ints.tolist(), got.floats.tolist()):
        ints, floats = iter(ints), iter(floats)
        rows.append([next(ints) if i else next(floats) for i in is_int])
    return rows


def _publish_job(cfg: RunConfig, reporter, comm, outcome: RankOutcome) -> None:
    pool = outcome.pool
    mine = [1, outcome.steps, outcome.verified_gradients, int(outcome.launch_blocking)] + \
        [pool[name] for name, _ in OUTCOME_FIELDS[4:]]
    rows = exchange(comm, mine, OUTCOME_FIELDS)
    if outcome.rank != 0:
        return
    launch = cfg.launch
    ranks = [{"rank": r, "node": launch.node_of(r), **dict(zip((n for n, _ in OUTCOME_FIELDS),
                                                              row))}
             for r, row in enumerate(rows)]
    reporter.publish(JOB, {"world": outcome.world_size, "nodes": launch.nodes,
                           "ranks_per_node": launch.local_ranks, "ranks": ranks})


def _cluster_failed(cfg: RunConfig, out_dir, exc: RuntimeError) -> RankOutcome:
    """``communication.init()`` gave up: the cluster did not form in time. Recorded in this
    rank's report (msrun exported its rank) with a message that says what to check."""
    rank = int(os.environ.get("RANK_ID", 0))
    world = int(os.environ.get("MS_WORKER_NUM", cfg.launch.ranks))
    launch = cfg.launch
    text = " ".join(str(exc).split())
    first = text.split(". ", 1)[0].rstrip(".") + "."       # MindSpore's first sentence
    peers = ("; the other nodes must run `gradpool train` with their own launch.node_rank, "
             f"and reach {launch.master_addr}:{launch.master_port}" if launch.nodes > 1 else "")
    message = (f"the cluster of {world} ranks did not form within launch.cluster_timeout_s = "
               f"{launch.cluster_timeout_s} s (MindSpore: {first}){peers}")
    outcome = RankOutcome(rank=rank, world_size=world, status=STATUS_FAILED,
                          error_type=ClusterFormationError.__name__, error_message=message)
    rank_report.reporter_for(out_dir, rank, world).publish(OUTCOME, dataclasses.asdict(outcome))
    return outcome


def _expected(exc: Exception) -> bool:
    """Failures the run detects on purpose: their message says it all, no traceback needed."""
    return isinstance(exc, (NonFiniteLossError, GradientIntegrityError, CheckpointError,
                            StateMismatchError, ConfigError))


def read_job_steps(report) -> list:
    """Rank 0's ``job_steps`` entries, in step order (empty before the first step ends)."""
    entries = report.results.get(JOB_STEPS, {}) if report is not None else {}
    return [entries[key] for key in sorted(entries, key=int)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradpool.app.rank_main",
                                     description="One rank of `gradpool train`.")
    parser.add_argument("--config", required=True, help="resolved YAML written by the launcher")
    parser.add_argument("--out-dir", required=True, help="where step records and outcome go")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config key")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    cfg = load_config(args.config, args.overrides)
    prepare_process(cfg.launch)
    # Under msrun the scheduler process runs this too; it serves the cluster inside
    # init_distributed() (called first thing in run_rank) and never gets past it.
    outcome = run_rank(cfg, args.out_dir, log_steps=True)
    if not outcome.ok:
        print(f"gradpool train: {outcome.describe_error()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
