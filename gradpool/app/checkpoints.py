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
starts (:func:`check_resume`); ``train.steps`` may grow. So do the ``fully_shard`` settings that
change the gradients (``FULLY_SHARD_KEYS``): a checkpoint that records none of them (saved before
they were recorded) is accepted with a warning.

``train.resume_from: latest`` resumes from the newest committed, intact ``step-<N>`` directory
under ``train.save_dir`` (:func:`find_latest`; a newer one that is uncommitted or damaged is
skipped and logged); with no committed checkpoint there the run starts from step 0 and says so,
as Megatron's and torchtitan's do. ``train.keep_last: N`` removes, after each save, the committed
step directories older than the newest N (:func:`hyper_parallel.checkpoint.steps.prune`).

With ``train.async_save`` each save is written in the background (:class:`StepSaver`): it is
committed, and ``keep_last`` prunes after it, at the end of the first step after every rank's
write finished (at the latest at the next save or the end of the run); before that ``latest``
does not see it. ``train.verify_checkpoint: false`` (or ``gradpool train
--no-verify``) skips the checksums of ``resume_from`` before the launch and in the ranks' load,
and the launcher says so.

Every rank of the job calls :func:`save_step` and :func:`resume` (the checkpoint API's
collectives); the launcher calls :func:`read_checkpoint` and :func:`check_resume` before anything
is launched, so a bad ``resume_from`` costs no launch.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from gradpool.app.config import RunConfig
from gradpool.errors import CheckpointError, StateMismatchError
from gradpool.app.errors import ConfigValueError

logger = logging.getLogger(__name__)

WRITER = "gradpool train"
# The rank report key under which each rank publishes the newest checkpoint it saw committed
# ({"path", "step"}), for the launcher's line when a signal stops the run.
LAST_CHECKPOINT = "last_checkpoint"
# ... and the save it has started and not committed yet ({"path", "step"}, or None): a stop
# signal lets it finish and commit first (gradpool.app.supervise, train.stop_save_grace_s).
SAVE_IN_FLIGHT = "save_in_flight"
# What decides the batches and the updates besides the saved state (see the module docstring).
TRAJECTORY_KEYS = ("seed", "micro_steps", "optimizer", "learning_rate")
# fully_shard settings that change the gradients or the sharding a run trains with
FULLY_SHARD_KEYS = ("reduce_op", "gradient_scaling_factor", "reduce_dtype", "param_dtype",
                    "apply_grad_on_fp32_main_grad", "mesh_shape")
LATEST = "latest"           # train.resume_from's keyword


def step_dir(save_dir, steps_done: int) -> Path:
    """Where the checkpoint after ``steps_done`` optimizer steps goes."""
    from hyper_parallel.checkpoint import steps
    return steps.step_dir(save_dir, steps_done)


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
            "train": {key: getattr(cfg.train, key) for key in TRAJECTORY_KEYS},
            "fully_shard": {key: _plain(getattr(cfg.fully_shard, key))
                            for key in FULLY_SHARD_KEYS}}


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


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
    tensor) when there is none or one fails. The launcher's pre-launch check passes
    ``checksums`` unless ``train.verify_checkpoint`` is false; the ranks, which verify the
    checksums of what they read in their load, read headers only here."""
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
    saved_fs = extra.get("fully_shard")
    if not isinstance(saved_fs, dict):
        logger.warning("%s records no fully_shard settings (saved before they were recorded): "
                       "resuming without checking %s", where, ", ".join(
                           f"fully_shard.{key}" for key in FULLY_SHARD_KEYS))
        return
    for key in FULLY_SHARD_KEYS:
        _check_same(f"fully_shard.{key}", saved_fs.get(key),
                    _plain(getattr(cfg.fully_shard, key)), where)


def _check_same(key: str, saved: Any, now: Any, where: str) -> None:
    if saved != now:
        raise StateMismatchError(
            f"{where} was saved with {key} = {saved!r}, this run has {now!r}; resuming continues "
            f"the saved training: set {key} = {saved!r} (or start a new run without "
            "train.resume_from)")


def _check_model(cfg: RunConfig, saved: dict, where: str) -> None:
    for f in dataclasses.fields(cfg.model):
        # batch_size is per rank: the global batch is checked instead; expert_parallel is how
        # the experts are split over ranks, and a checkpoint holds every expert: any split loads
        if f.name not in ("batch_size", "expert_parallel"):
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


# -- the step directories of a save_dir: latest and retention ---------------------------------
def find_latest(save_dir, checksums: bool = True) -> tuple[Optional[CheckpointInfo], list[str]]:
    """The newest committed, intact step checkpoint under ``save_dir`` (None: none committed)
    and, newest first, why each newer step directory was passed over
    (:func:`hyper_parallel.checkpoint.steps.newest`, which refuses a ``save_dir`` whose
    committed checkpoints are all damaged)."""
    from hyper_parallel.checkpoint import steps
    found = steps.newest(save_dir, verify=checksums)
    if found.path is None:
        return None, found.skipped
    index = found.index
    return CheckpointInfo(found.path, index.step, index.extra, index.world_size,
                          sum(index.files.values())), found.skipped


def resolve_latest(cfg: RunConfig) -> tuple[RunConfig, Optional[CheckpointInfo], list[str]]:
    """``cfg`` with ``train.resume_from: latest`` replaced by the newest committed, intact step
    directory (or by null: none committed, start from step 0), that checkpoint's info, and the
    lines that say what was chosen and what skipped. Other configs come back unchanged."""
    train = cfg.train
    if train.resume_from != LATEST:
        return cfg, None, []
    info, skipped = find_latest(train.save_dir, checksums=train.verify_checkpoint)
    notes = [f"train.resume_from = latest: skipped {why}" for why in skipped]
    if info is None:
        notes.append(f"train.resume_from = latest: no committed checkpoint under "
                     f"{train.save_dir}; starting from step 0")
        resolved = None
    else:
        notes.append(f"train.resume_from = latest: {info.path} (step {info.step})")
        resolved = str(info.path)
    return dataclasses.replace(cfg, train=dataclasses.replace(train, resume_from=resolved)), \
        info, notes


def removed_text(saved: dict) -> str:
    """What a saved step's line adds for the directories ``train.keep_last`` removed after it,
    and those it could not remove whole (retried at the next save)."""
    removed, left = saved.get("removed") or [], saved.get("not_removed") or []
    text = ""
    if removed:
        text += f"; removed {', '.join(Path(p).name for p in removed)} (train.keep_last)"
    if left:
        text += (f"; could not remove {', '.join(Path(p).name for p in left)} (train.keep_last: "
                 "see the rank's log; retried at the next save)")
    return text


def background_text(saved: dict) -> str:
    """What a committed save's line adds when it was written in the background."""
    if not saved.get("asynchronous"):
        return ""
    return f" in the background, training blocked {saved['blocked_seconds']:.2f} s"


# -- on the ranks ------------------------------------------------------------------------------
def save_step(cfg: RunConfig, model, optimizer, steps_done: int, world: int,
              rank: int = 0) -> dict:
    """Save after ``steps_done`` steps (every rank calls it); what the step line shows. With
    ``train.keep_last``, rank 0 then removes the step directories beyond the newest N
    (``removed``)."""
    from hyper_parallel import checkpoint
    result = checkpoint.save(step_dir(cfg.train.save_dir, steps_done), model, optimizer,
                             step=steps_done, extra=run_extra(cfg, world))
    return _committed(cfg, result, rank)


def _committed(cfg: RunConfig, result, rank: int) -> dict:
    """A committed save as the step line and the summary show it, after ``train.keep_last``
    pruned (rank 0: a step directory goes only once a newer one committed)."""
    from hyper_parallel.checkpoint import steps
    pruned = steps.Pruned()
    if cfg.train.keep_last is not None and rank == 0:     # committed on every rank by now
        pruned = steps.prune(cfg.train.save_dir, cfg.train.keep_last, result.step,
                             holder=f"{WRITER} train.keep_last (pid {os.getpid()})")
    return {"step": result.step, "path": result.path, "bytes": result.total_bytes,
            "seconds": result.seconds, "blocked_seconds": result.blocked_seconds,
            "asynchronous": result.asynchronous, "removed": pruned.removed,
            "not_removed": list(pruned.left)}


class StepSaver:
    """The saves of one rank of a run: synchronous, or with ``train.async_save`` in the
    background. Every rank calls :meth:`after_step` after each step, :meth:`commit_if_written`
    once the ranks have learned whether every rank's background write has finished (the run's
    per-step exchange carries :meth:`written`), and :meth:`finish` once training ended well (all
    three are wait points of the checkpoint API: collective). A background save is so committed
    at the end of the first step after the last rank's write finished: a kill loses what a
    synchronous save would, plus the steps the write overlapped. ``announce(step, path)`` is
    called when a save starts (its commit is in the dict the call that commits it returns)."""

    def __init__(self, cfg: RunConfig, model, optimizer, world: int, rank: int,
                 announce: Optional[Callable[[int, str], None]] = None):
        self.cfg, self.model, self.optimizer = cfg, model, optimizer
        self.world, self.rank = world, rank
        self.announce = announce
        self.pending = None         # the asynchronous save not committed yet
        self.started: Optional[dict] = None     # the save the last after_step started

    def after_step(self, steps_done: int) -> Optional[dict]:
        """Save when :func:`save_due`; the save committed by this call (synchronous: this step's;
        asynchronous: the previous one's when its write still ran, since it must commit before
        the next starts), or None. :attr:`started` says what an asynchronous save started."""
        self.started = None
        if not save_due(self.cfg, steps_done):
            return None
        path = str(step_dir(self.cfg.train.save_dir, steps_done))
        if not self.cfg.train.async_save:
            self._announce(steps_done, path)
            return save_step(self.cfg, self.model, self.optimizer, steps_done, self.world,
                             self.rank)
        from hyper_parallel import checkpoint
        committed = self.finish()
        self._announce(steps_done, path)
        self.pending = checkpoint.save(path, self.model, self.optimizer, step=steps_done,
                                       extra=run_extra(self.cfg, self.world), async_save=True)
        self.started = {"step": steps_done, "path": self.pending.path}
        return committed

    def written(self) -> bool:
        """Whether this rank's background write of a save started before this step has finished
        (False with none pending, and for one started by this step's :meth:`after_step`, so a
        step commits at most one save)."""
        return self.pending is not None and self.started is None and self.pending.done()

    def commit_if_written(self, every_rank_written: bool) -> Optional[dict]:
        """Commit the pending save when ``every_rank_written`` (every rank's :meth:`written`, as
        the per-step exchange reported it: the same on every rank); its dict, or None."""
        from hyper_parallel import checkpoint
        if self.pending is None or not every_rank_written:
            return None
        if checkpoint.pending() is not self.pending:
            raise CheckpointError(f"the background save of {self.pending.path} is no longer the "
                                  "process's pending one: another save ran in between")
        pending, self.pending = self.pending, None
        return _committed(self.cfg, checkpoint.commit_ready(True), self.rank)

    def finish(self) -> Optional[dict]:
        """Commit the pending asynchronous save (the end of the run waits for it); its dict."""
        pending, self.pending = self.pending, None
        return None if pending is None else _committed(self.cfg, pending.wait(), self.rank)

    def _announce(self, step: int, path: str) -> None:
        if self.announce is not None:
            self.announce(step, path)


def resume(cfg: RunConfig, model, optimizer, world: int) -> dict:
    """Load ``train.resume_from`` into ``model`` and ``optimizer`` (every rank calls it), after
    :func:`check_resume`; ``{"path", "step", "world_size", "bytes_read", "seconds"}`` (bytes
    read by this rank; ``world_size`` the saving run's)."""
    from hyper_parallel import checkpoint
    info = read_checkpoint(cfg.train.resume_from)
    check_resume(cfg, info, world)
    loaded = checkpoint.load(info.path, model, optimizer, verify=cfg.train.verify_checkpoint)
    if loaded["step"] != info.step:     # another run saved into it between the two reads
        raise CheckpointError(f"{info.path} changed while it was loaded (step {info.step}, then "
                              f"{loaded['step']}); resume again once nothing writes to it")
    logger.info("resumed from %s at step %d", info.path, info.step)
    return {"path": str(info.path), "step": info.step, "world_size": info.world_size,
            "bytes_read": loaded["bytes_read"], "seconds": loaded["seconds"]}
