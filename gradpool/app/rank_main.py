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
  failed, the pool's final statistics and how many gradients were verified intact.

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
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import mindspore as ms

from gradpool.app import rank_report
from gradpool.app.train import NonFiniteLossError, build_sharded_model, train_sharded
from gradpool.comm import init_distributed
from gradpool.app.config import RunConfig, load_config
from gradpool.errors import GradientIntegrityError, InvalidArgumentError
from gradpool.runtime import runtime_for

logger = logging.getLogger(__name__)

STATUS_OK, STATUS_FAILED = "ok", "failed"
STEPS, OUTCOME = "steps", "outcome"      # the keys of this program's rank report results


@dataclass
class RankOutcome:
    """How one rank's training ended (``results["outcome"]`` of its rank report)."""

    rank: int
    world_size: int
    status: str = STATUS_OK
    steps: int = 0                      # steps completed
    error_type: Optional[str] = None
    error_message: Optional[str] = None
    verify_gradients: bool = False
    verified_gradients: int = 0         # gradients checksummed intact after their reduce path
    pool: dict = field(default_factory=dict)   # gradpool.pool.PoolStats as a dict

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    def describe_error(self) -> str:
        return f"rank {self.rank}: {self.error_type}: {self.error_message}"

    @classmethod
    def from_dict(cls, data: dict) -> "RankOutcome":
        return cls(**data)


def run_rank(cfg: RunConfig, out_dir, on_step: Optional[Callable] = None) -> RankOutcome:
    """Train this process's rank (MindSpore's device must be set already), publishing its steps
    and outcome in its rank report.

    Never raises for a training failure: the returned outcome (also published) says what went
    wrong."""
    rank, world = init_distributed()
    reporter = rank_report.reporter_for(out_dir, rank, world)
    outcome = RankOutcome(rank=rank, world_size=world,
                          verify_gradients=cfg.gradpool.verify_gradients)
    steps: list = []
    model = runtime = None
    try:
        if world != cfg.launch.ranks:
            raise InvalidArgumentError(
                f"this process is rank {rank} of {world}, but launch.ranks = {cfg.launch.ranks}; "
                "start exactly launch.ranks processes")
        model = build_sharded_model(cfg)
        runtime = runtime_for(cfg.gradpool)
        reporter.publish(STEPS, steps)

        def write(record) -> None:
            steps.append(dataclasses.asdict(record))
            reporter.publish(STEPS, steps)
            outcome.steps = record.step + 1
            if on_step is not None:
                on_step(record)
        train_sharded(cfg, model, runtime.comm, runtime.pool, on_step=write)
    except Exception as exc:  # noqa: BLE001 - the process boundary: record, then report
        outcome.status = STATUS_FAILED
        outcome.error_type = type(exc).__name__
        outcome.error_message = " ".join(str(exc).split()) or repr(exc)
        logger.debug("rank %d failed", rank, exc_info=True)
        if not _expected(exc):
            traceback.print_exc()
    if runtime is not None:
        outcome.pool = dataclasses.asdict(runtime.pool.stats())
    if model is not None:
        outcome.verified_gradients = sum(
            getattr(getattr(p, "hsdp_param", None), "verified_gradients", 0)
            for p in model.trainable_params())
    reporter.publish(OUTCOME, dataclasses.asdict(outcome))
    return outcome


def _expected(exc: Exception) -> bool:
    """Failures the run detects on purpose: their message says it all, no traceback needed."""
    return isinstance(exc, (NonFiniteLossError, GradientIntegrityError))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradpool.app.rank_main",
                                     description="One rank of `gradpool train`.")
    parser.add_argument("--config", required=True, help="resolved YAML written by the launcher")
    parser.add_argument("--out-dir", required=True, help="where step records and outcome go")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    cfg = load_config(args.config)
    ms.set_device(cfg.launch.device)
    # Under msrun the scheduler process runs this too; it serves the cluster inside
    # init_distributed() (called first thing in run_rank) and never gets past it.
    outcome = run_rank(cfg, args.out_dir)
    if not outcome.ok:
        print(f"gradpool train: {outcome.describe_error()}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
