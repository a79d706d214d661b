"""Checkpoints of ``gradpool train``: when to save, where, and whether a checkpoint can be resumed.

A run with ``train.save_dir`` saves the model and the optimizer after every ``train.save_every``
steps and after its last step, each time into its own directory ``<save_dir>/step-00000004``
(:func:`hyper_parallel.checkpoint.save` writes it: one file per rank and an index). A later run
with ``train.resume_from`` naming one of those directories loads it at its own world size and
continues with the next step up to ``train.steps``.

Resuming continues *the same* training, so the checkpoint records (in its ``extra``) what decides
the trajectory besides the state: the model's shape, the global batch (``model.batch_size`` is
per rank, so at another world size it must change to keep the same batches), the seed, the
micro-steps, the optimizer and its learning rate (a Parameter of the optimizer's state, which the
load would restore over the config's). A run that differs in any of them is refused before it
starts (:func:`check_resume`); ``train.steps`` may grow.

Every rank of the job calls :func:`save_step` and :func:`resume` (the checkpoint API's
collectives); the launcher calls :func:`read_checkpoint` and :func:`check_resume` before anything
is launched, so a bad ``resume_from`` costs no launch.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gradpool.app.config import RunConfig
from gradpool.errors import CheckpointError, StateMismatchError
from gradpool.app.errors import ConfigValueError

logger = logging.getLogger(__name__)

WRITER = "gradpool train"
# The rank report key under which each rank publishes the newest checkpoint it saw committed
# ({"path", "step"}), for the launcher's line when a signal stops the run.
LAST_CHECKPOINT = "last_checkpoint"
STEP_DIR_PREFIX = "step-"
# What decides the batches and the updates besides the saved state (see the module docstring).
TRAJECTORY_KEYS = ("seed", "micro_steps", "optimizer", "learning_rate")


def step_dir(save_dir, steps_done: int) -> Path:
    """Where the checkpoint after ``steps_done`` optimizer steps goes."""
    return Path(save_dir) / f"{STEP_DIR_PREFIX}{steps_done:08d}"


def save_due(cfg: RunConfig, steps_done: int) -> bool:
    """Whether the run saves after its ``steps_done``-th step: every ``save_every`` steps, and
    after the last (the final state is always kept when there is a ``save_dir``)."""
    train = cfg.train
    if train.save_dir is None:
        return False
    every = train.save_every
    return steps_done == train.steps or (every is not None and steps_done % every == 0)


def run_extra(cfg: RunConfig, world: int) -> dict:
    """What the checkpoint records besides the state, for :func:`check_resume`."""
    return {"writer": WRITER, "world_size": world,
            "global_batch": cfg.model.batch_size * world,
            "model": dataclasses.asdict(cfg.model),
            "train": {key: getattr(cfg.train, key) for key in TRAJECTORY_KEYS}}


@dataclass(frozen=True)
class CheckpointInfo:
    """A checkpoint's index, read without loading anything."""

    path: Path
    step: Optional[int]
    extra: Any
    world_size: int
    bytes: int              # every rank file together


def read_checkpoint(path, checksums: bool = False) -> CheckpointInfo:
    """The index of the checkpoint in ``path``, after checking every rank file against it (its
    size and save id, each piece's dtype, shape and extent: headers only, cheap; with
    ``checksums`` every piece's bytes too); :class:`CheckpointError` naming the file (and the
    tensor) when there is none or one fails. Without ``checksums`` a flipped byte is found by
    the ranks' own load, which verifies checksums."""
    from hyper_parallel.checkpoint import files
    root = Path(path)
    index = files.read_index(root)
    files.verify_checkpoint(root, index, checksums=checksums)
    return CheckpointInfo(root, index.step, index.extra, index.world_size,
                          sum(index.files.values()))


def check_resume(cfg: RunConfig, info: CheckpointInfo, world: int) -> None:
    """Refuse a resume that would not continue the checkpoint's training: a checkpoint
    ``gradpool train`` did not write, a step with nothing left to train, or a model, global batch,
    seed, micro-step count or optimizer other than the saved one."""
    where = f"train.resume_from = {str(info.path)!r}"
    extra = info.extra if isinstance(info.extra, dict) else {}
    if extra.get("writer") != WRITER or not isinstance(info.step, int):
        raise StateMismatchError(
            f"{where} was not written by {WRITER} (its index records no training step and run "
            "settings); resume from a step-<N> directory of a train.save_dir")
    if info.step >= cfg.train.steps:
        raise ConfigValueError(
            f"{where} holds step {info.step} and train.steps = {cfg.train.steps}: nothing is "
            f"left to train; set train.steps above {info.step} to train further",
            key="train.steps", given=cfg.train.steps, allowed=f"an integer > {info.step}")
    _check_model(cfg, extra.get("model", {}), where)
    _check_global_batch(cfg, extra, world, where)
    saved_train = extra.get("train", {})
    for key in TRAJECTORY_KEYS:
        _check_same(f"train.{key}", saved_train.get(key), getattr(cfg.train, key), where)


def _check_same(key: str, saved: Any, now: Any, where: str) -> None:
    if saved != now:
        raise StateMismatchError(
            f"{where} was saved with {key} = {saved!r}, this run has {now!r}; resuming continues "
            f"the saved training: set {key} = {saved!r} (or start a new run without "
            "train.resume_from)")


def _check_model(cfg: RunConfig, saved: dict, where: str) -> None:
    for f in dataclasses.fields(cfg.model):
        if f.name != "batch_size":          # per rank: the global batch is checked instead
            _check_same(f"model.{f.name}", saved.get(f.name), getattr(cfg.model, f.name), where)


def _check_global_batch(cfg: RunConfig, extra: dict, world: int, where: str) -> None:
    saved = extra.get("global_batch")
    now = cfg.model.batch_size * world
    if saved == now:
        return
    hint = (f"set model.batch_size = {saved // world}" if isinstance(saved, int)
            and saved % world == 0 else f"no model.batch_size gives {saved} at {world} ranks")
    raise StateMismatchError(
        f"{where} was saved with a global batch of {saved} sequences (model.batch_size "
        f"{extra.get('model', {}).get('batch_size')} x {extra.get('world_size')} ranks), this run "
        f"has {now} ({cfg.model.batch_size} x {world}): the batches would differ; {hint}")


# -- on the ranks ------------------------------------------------------------------------------
def save_step(cfg: RunConfig, model, optimizer, steps_done: int, world: int) -> dict:
    """Save after ``steps_done`` steps (every rank calls it); what the step line shows."""
    from hyper_parallel import checkpoint
    result = checkpoint.save(step_dir(cfg.train.save_dir, steps_done), model, optimizer,
                             step=steps_done, extra=run_extra(cfg, world))
    return {"step": steps_done, "path": result.path, "bytes": result.total_bytes,
            "seconds": result.seconds}


def resume(cfg: RunConfig, model, optimizer, world: int) -> dict:
    """Load ``train.resume_from`` into ``model`` and ``optimizer`` (every rank calls it), after
    :func:`check_resume`; ``{"path", "step", "world_size", "bytes_read", "seconds"}`` (bytes
    read by this rank; ``world_size`` the saving run's)."""
    from hyper_parallel import checkpoint
    info = read_checkpoint(cfg.train.resume_from)
    check_resume(cfg, info, world)
    loaded = checkpoint.load(info.path, model, optimizer)
    if loaded["step"] != info.step:     # another run saved into it between the two reads
        raise CheckpointError(f"{info.path} changed while it was loaded (step {info.step}, then "
                              f"{loaded['step']}); resume again once nothing writes to it")
    logger.info("resumed from %s at step %d", info.path, info.step)
    return {"path": str(info.path), "step": info.step, "world_size": info.world_size,
            "bytes_read": loaded["bytes_read"], "seconds": loaded["seconds"]}
