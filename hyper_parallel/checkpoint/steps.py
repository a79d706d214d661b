"""The step checkpoints of a save directory, and the newest one that can be resumed.

A training run saves each checkpoint into its own directory ``<save_dir>/step-<8 digits>``
(:func:`step_dir`). :func:`latest` finds the newest that is *committed* (its ``index.json`` is
in place: a save killed before its commit, or an asynchronous save not yet waited for, has
none) and *intact* (every rank file's size, save id and header agree with the index, with
``verify`` every piece's checksum too, and the index holds the step the directory's name says).
:func:`prune` keeps the newest N committed ones. Reads and removes files only: no collective, no
model.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gradpool import CheckpointError, check_bool, check_int
from hyper_parallel.checkpoint import files

logger = logging.getLogger(__name__)

STEP_DIR_PREFIX = "step-"
_STEP_NAME = re.compile(r"^step-(\d{8})$")


def step_dir(save_dir, step: int) -> Path:
    """Where the checkpoint after ``step`` optimizer steps goes."""
    return Path(save_dir) / f"{STEP_DIR_PREFIX}{step:08d}"


def step_dirs(save_dir) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-<8 digits>`` directory directly in ``save_dir`` (not a
    symlink: nothing outside it is ever ours), oldest first."""
    root = Path(save_dir)
    try:
        children = list(root.iterdir())
    except OSError:
        return []
    found = []
    for child in children:
        match = _STEP_NAME.match(child.name)
        if match and child.is_dir() and not child.is_symlink():
            found.append((int(match.group(1)), child))
    return sorted(found)


def check_step_checkpoint(path: Path, step: int, verify: bool) -> files.Index:
    """The index of the committed step checkpoint ``path``, every file checked against it; a
    :class:`CheckpointError` naming what is wrong."""
    index = files.read_index(path)
    files.verify_checkpoint(path, index, checksums=verify)
    if index.step != step:
        raise CheckpointError(f"{path / files.INDEX} holds step {index.step}, its directory's "
                              f"name says {step}")
    return index


@dataclass
class Scan:
    """What :func:`scan` found: the newest committed, intact step (or None), and newest first
    why each newer directory was passed over (``damaged``: the committed ones among them)."""

    step: Optional[int] = None
    path: Optional[Path] = None
    index: Optional[files.Index] = None
    skipped: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)


def scan(save_dir, verify: bool = True) -> Scan:
    """The newest committed, intact step checkpoint under ``save_dir`` and why each newer one
    was passed over (see the module docstring)."""
    check_bool("verify", verify)
    found = Scan()
    for step, path in reversed(step_dirs(save_dir)):
        if not (path / files.INDEX).is_file():
            found.skipped.append(f"{path.name}: not committed (no {files.INDEX}: a save that "
                                 "did not finish)")
            continue
        try:
            index = check_step_checkpoint(path, step, verify)
        except CheckpointError as exc:
            reason = " ".join(str(exc).split())
            found.skipped.append(f"{path.name}: damaged ({reason})")
            found.damaged.append(f"{path.name}: {reason}")
            continue
        found.step, found.path, found.index = step, path, index
        return found
    return found


def newest(save_dir, *, verify: bool = True) -> Scan:
    """:func:`scan`, refusing a ``save_dir`` whose committed checkpoints are all damaged with a
    :class:`CheckpointError` naming each: starting over them would throw the training away."""
    found = scan(save_dir, verify)
    if found.path is None and found.damaged:
        raise CheckpointError(f"every committed checkpoint under {save_dir} is damaged "
                              f"({'; '.join(found.damaged)}); repair or move them away")
    return found


def latest(save_dir, *, verify: bool = True) -> Optional[Path]:
    """The newest committed, intact ``step-<N>`` directory under ``save_dir``, or None when none
    is committed (a first run). ``verify``: check every piece's checksum too (reads every byte
    of the candidate; False checks sizes, save ids and headers only). A ``save_dir`` whose
    committed checkpoints are all damaged is refused (:func:`newest`)."""
    return newest(save_dir, verify=verify).path


# -- keeping the newest N ------------------------------------------------------------------------
# what a save writes into a step directory: the index (and its temporary names), the lock, and
# the generation directories (hyper_parallel.checkpoint.files)
_SAVE_NAMES = re.compile(rf"^({re.escape(files.INDEX)}|{re.escape(files.INDEX)}\..+\.tmp|"
                         rf"{re.escape(files.DirectoryLock.NAME)}|"
                         rf"{re.escape(files.GENERATION_PREFIX)}\d{{8}})$")
_SHOWN = 8          # leftovers named in a log line; the rest are counted


@dataclass
class Pruned:
    """What :func:`prune` did: the step directories it removed (oldest first), and those it could
    not remove whole, each with what remained of it (uncommitted: :func:`latest` skips them, the
    next prune retries them); ``busy``: held by another writer's lock, left as they are."""

    removed: list[str] = field(default_factory=list)
    left: dict[str, list[str]] = field(default_factory=dict)
    busy: list[str] = field(default_factory=list)


def prune(save_dir, keep_last: int, saved_step: int, holder: str) -> Pruned:
    """After the checkpoint of ``saved_step`` committed: remove the step directories older than
    it that are not among the newest ``keep_last`` committed ones (``saved_step``'s counted), and
    older uncommitted ones (killed saves, or removals an earlier prune could not finish: retried
    here). Never the one just saved, never a newer one (left by an earlier run that went
    further), never a directory another writer holds the lock of, never anything but a
    ``step-<N>`` directory holding only what a save writes. Each is uncommitted first (its index
    removed under its :class:`~hyper_parallel.checkpoint.files.DirectoryLock`, taken as
    ``holder``), so a removal cut short or failing part-way leaves an uncommitted directory,
    which :func:`latest` skips; each failure is logged with the path and what remained."""
    check_int("keep_last", keep_last, 1)
    older = [(step, path) for step, path in step_dirs(save_dir) if step < saved_step]
    committed = [path for _, path in older if (path / files.INDEX).is_file()]
    keep = set(committed[-(keep_last - 1):] if keep_last > 1 else [])
    pruned = Pruned()
    for _, path in older:
        if path in keep or not _only_ours(path):
            continue
        _remove_step(path, holder, pruned)
    return pruned


def _only_ours(path: Path) -> bool:
    try:
        return all(_SAVE_NAMES.match(child.name) for child in path.iterdir())
    except OSError:
        return False


def _remove_step(path: Path, holder: str, pruned: Pruned) -> None:
    """Remove one step directory under its save lock, recording the outcome in ``pruned``."""
    lock = files.DirectoryLock(path, holder)
    try:
        lock.__enter__()
    except CheckpointError:
        logger.warning("keep_last: %s is being saved by another writer; left", path)
        pruned.busy.append(str(path))
        return
    except OSError as exc:
        _left(path, pruned, f"its lock could not be taken ({exc})")
        return
    try:
        try:
            (path / files.INDEX).unlink(missing_ok=True)        # uncommitted from here on
        except OSError as exc:
            _left(path, pruned, f"it could not be uncommitted ({exc}); it stays committed")
            return
        failures = _remove_tree(path)
    finally:
        lock.__exit__(None, None, None)
    if failures:
        _left(path, pruned, "; ".join(failures[:_SHOWN]))
    else:
        pruned.removed.append(str(path))


def _remove_tree(root: Path) -> list[str]:
    """Remove ``root`` and everything in it, bottom up, going on past failures; each failure as
    ``relative path: error`` (a directory that failed only because something in it did is not
    listed again)."""
    failures: list[str] = []
    failed_dirs: set[str] = set()

    def attempt(remove, path: str) -> bool:
        try:
            remove(path)
            return True
        except OSError as exc:
            failures.append(f"{os.path.relpath(path, root)}: {exc.strerror or exc}")
            return False

    for here, dirs, names in os.walk(root, topdown=False):
        ok = True
        for name in names:
            ok &= attempt(os.unlink, os.path.join(here, name))
        for name in dirs:
            child = os.path.join(here, name)
            if os.path.islink(child):
                ok &= attempt(os.unlink, child)
            elif child in failed_dirs:
                ok = False
            else:
                ok &= attempt(os.rmdir, child)
        if not ok:
            failed_dirs.add(here)
    if str(root) not in failed_dirs:
        attempt(os.rmdir, str(root))
    return failures


def _remaining(path: Path) -> list[str]:
    """What is still in ``path``, as paths relative to it, sorted."""
    found = []
    for here, _, names in os.walk(path):
        found += [os.path.relpath(os.path.join(here, n), path) for n in names]
    return sorted(found)


def _left(path: Path, pruned: Pruned, why: str) -> None:
    remaining = _remaining(path) if path.exists() else []
    pruned.left[str(path)] = remaining
    shown = ", ".join(remaining[:_SHOWN]) + (
        f" and {len(remaining) - _SHOWN} more" if len(remaining) > _SHOWN else "")
    logger.warning("keep_last: could not remove %s (%s); what remains: %s. It is uncommitted "
                   "unless said otherwise, so latest() skips it, and the next prune retries it",
                   path, why, shown or "nothing")
