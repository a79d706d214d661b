"""The step checkpoints of a save directory, and the newest one that can be resumed.

A training run saves each checkpoint into its own directory ``<save_dir>/step-<8 digits>``
(:func:`step_dir`). :func:`latest` finds the newest that is *committed* (its ``index.json`` is
in place: a save killed before its commit, or an asynchronous save not yet waited for, has
none) and *intact* (every rank file's size, save id and header agree with the index, with
``verify`` every piece's checksum too, and the index holds the step the directory's name says).
Reads files only: no collective, no model.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from gradpool import CheckpointError, check_bool
from hyper_parallel.checkpoint import files

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


def latest(save_dir, *, verify: bool = True) -> Optional[Path]:
    """The newest committed, intact ``step-<N>`` directory under ``save_dir``, or None when none
    is committed (a first run). ``verify``: check every piece's checksum too (reads every byte
    of the candidate; False checks sizes, save ids and headers only). A ``save_dir`` whose
    committed checkpoints are all damaged is a :class:`CheckpointError` naming each: starting
    over them would throw the training away."""
    found = scan(save_dir, verify)
    if found.path is None and found.damaged:
        raise CheckpointError(f"every committed checkpoint under {save_dir} is damaged "
                              f"({'; '.join(found.damaged)}); repair or move them away")
    return found.path
