"""Saving a distributed checkpoint, in the caller's time or in the background.

Every rank of the world calls :func:`save` with the same path (a file system all ranks share).
A save runs in four parts:

1. *prepare* (collective: two small all-reduces): rank 0 locks the directory (one writer at a
   time), reserves a new generation directory and draws the save's id; every rank learns both.
2. *snapshot*: each rank takes the pieces it writes as NumPy arrays (a synchronous save reads
   the tensors' own memory; an asynchronous one copies them, so training may change the
   parameters as soon as :func:`save` returns).
3. *write* (local, no collective): each rank checksums its pieces and writes its file.
4. *commit* (collective): every rank says whether its write succeeded, rank 0 reads the files'
   piece tables, checks that every tensor is covered exactly once, renames the index into place
   and removes the generations it superseded, then unlocks.

A synchronous save runs the four in the call. ``async_save=True`` runs 1 and 2 in the call,
3 on a background thread, and 4 at the next *wait point*: the next :func:`save`, a
:func:`hyper_parallel.checkpoint.load`, :func:`wait` or the handle's :meth:`AsyncSave.wait`, or
:func:`commit_ready` once every rank's write has finished (a training loop calls it after each
step, so a save is committed within one step of its last write, not at the next save).
The collectives stay on the caller's thread, in the program order every rank follows: the
background thread writes one file and calls no communicator, so it never runs a collective
next to the training's. Waiting is therefore collective too: every rank must reach the same
wait point. A checkpoint is *committed* (loadable, and what a reader looking for the latest
sees) only once its index is renamed into place, at that wait; a process that ends or dies
before it leaves an uncommitted generation, which the next commit in that directory removes.

A rank that fails makes every rank raise :class:`gradpool.CheckpointError` naming what failed
(for a background write, at the wait, naming the file), and the previous checkpoint stays the
loadable one.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from gradpool import (CheckpointError, InvalidArgumentError, all_sum_ints, check_bool,
                      communicator_for, exchange_ints)
from hyper_parallel.checkpoint import files
from hyper_parallel.core.dtensor.boxes import Box, check_cover
from hyper_parallel.core.fully_shard.state_dict import (StateEntry, model_entries,
                                                        optimizer_entries)

logger = logging.getLogger(__name__)
MODEL, OPTIMIZER = "model/", "optimizer/"
# Test hook (tests/test_kill_during_save.py): "STEP:SECONDS" makes every rank sleep SECONDS
# after writing its file of the save of step STEP, before the commit, so a test can kill a run
# while a save is surely in progress. Unset in any real run.
PAUSE_ENV = "GRADPOOL_TEST_SAVE_PAUSE"


@dataclass(frozen=True)
class SaveResult:
    path: str
    step: Optional[int]
    generation: int
    bytes_written: int         # by this rank
    total_bytes: int           # by every rank (the sizes the index records)
    seconds: float             # from the call to the commit
    blocked_seconds: float = 0.0    # of those, the caller waited (in the call and at the wait)
    asynchronous: bool = False
    write_seconds: float = 0.0      # this rank's checksums and file write (with its fsync)


def entries_of(model, optimizer) -> list[tuple[str, StateEntry]]:
    entries = [(MODEL + e.name, e) for e in model_entries(model)]
    if optimizer is not None:
        entries += [(OPTIMIZER + e.name, e) for e in optimizer_entries(model, optimizer)]
    return entries


def _from_rank0(comm, values: list[int]) -> list[int]:
    """Rank 0's non-negative ``values`` (each below 2**64: a generation, a byte count, a 64-bit
    save id) on every rank, exactly."""
    return [int(value) for value in exchange_ints(comm, values, unsigned=True)[0]]


def ranks_failing(comm, error: Optional[BaseException]) -> int:
    """How many ranks of ``comm`` had an ``error``: the barrier every step of a save (and the
    load's agreement) waits at."""
    return int(all_sum_ints(comm, [error is not None])[0])


def _agree(comm, error: Optional[BaseException], what: str) -> None:
    """Every rank raises if any rank failed ``what`` (so none goes on to the next barrier)."""
    failed = ranks_failing(comm, error)
    if error is not None:
        raise CheckpointError(f"checkpoint save: {what} failed on rank {comm.rank}: "
                              f"{type(error).__name__}: {error}") from error
    if failed:
        raise CheckpointError(f"checkpoint save: {what} failed on {int(failed)} other rank(s); "
                              "see their logs; the previous checkpoint is unchanged")


def checked_path(path) -> Path:
    if not isinstance(path, (str, Path)) or not str(path):
        raise InvalidArgumentError(f"checkpoint path must be a non-empty str or Path, got {path!r}")
    return Path(path)


def _check_save_args(path, step, extra) -> Path:
    root = checked_path(path)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise InvalidArgumentError(f"step must be an int >= 0 or None, got {step!r}")
    try:
        # strict JSON: NaN and infinities would make an index other JSON readers refuse
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"extra must be strict JSON (it goes into the index; no NaN "
                                   f"or infinity, no objects): {exc}") from exc
    return root


@dataclass
class _Save:
    """One save between its prepare and its commit."""

    root: Path
    comm: Any
    step: Optional[int]
    extra: Any
    generation: int
    save_id: str
    lock: Optional[files.DirectoryLock]     # rank 0's, held until the commit
    start: float
    name: str = ""                          # this rank's file, relative to root
    asynchronous: bool = False
    written: int = 0
    write_seconds: float = 0.0
    error: Optional[BaseException] = None   # of this rank's write

    def release(self) -> None:
        if self.lock is not None:
            self.lock.__exit__(None, None, None)
            self.lock = None


def _prepare(root: Path, step, extra, start: float) -> _Save:
    comm = communicator_for()
    lock = error = generation = save_id = None
    try:
        if comm.rank == 0:
            try:
                root.mkdir(parents=True, exist_ok=True)
                save_id = files.new_save_id()
                lock = files.DirectoryLock(root, f"pid {os.getpid()} on {socket.gethostname()}, "
                                                 f"save {files.save_id_text(save_id)}")
                lock.__enter__()
                generation = files.reserve_generation(root)
            except (OSError, CheckpointError) as exc:
                error = exc
        _agree(comm, error, f"preparing {root}")
        generation, save_id = _from_rank0(comm, [generation or 0, save_id or 0])
    except BaseException:
        if lock is not None:
            lock.__exit__(None, None, None)
        raise
    return _Save(root, comm, step, extra, generation, files.save_id_text(save_id), lock, start,
                 files.rank_file(generation, comm.rank))


# The host arrays of the last asynchronous save, refilled by the next one (whose call waits for
# that save first, so its background write has finished with them): a copy into memory already
# touched runs 2-5x faster than one into a fresh allocation, which page-faults every page. They
# stay allocated between saves (one host copy of this rank's pieces), as torchtitan keeps its
# pinned staging buffers.
_HOST_BUFFERS: dict[str, np.ndarray] = {}


def _snapshot(entries, copy: bool) -> tuple[dict, dict]:
    """This rank's pieces as arrays and their geometry; ``copy``: arrays this save owns (in the
    last asynchronous save's buffers where shapes and dtypes match), else views of the tensors,
    valid until they change."""
    global _HOST_BUFFERS
    arrays, pieces = {}, {}
    for key, entry in entries:
        if entry.writes:
            values = entry.local_values(copy=False)
            if copy:
                buffer = _HOST_BUFFERS.get(key)
                if buffer is None or buffer.shape != values.shape or \
                        buffer.dtype != values.dtype:
                    buffer = np.empty(values.shape, values.dtype)
                np.copyto(buffer, values)
                values = buffer
            arrays[key] = values
            pieces[key] = {"shape": list(entry.global_shape), "dtype": entry.dtype,
                           "offsets": list(entry.box.offsets), "lengths": list(entry.box.lengths)}
    if copy:
        _HOST_BUFFERS = arrays
    return arrays, pieces


def _write(save: _Save, arrays: dict, pieces: dict) -> None:
    """This rank's file (no collective: it may run on a background thread); a failure is kept
    for the commit, where every rank hears of it."""
    if save.error is not None:      # the snapshot failed: nothing to write
        return
    start = time.perf_counter()
    try:
        save.written = files.write_rank_file(save.root, save.name, arrays, pieces,
                                             save.save_id)
        save.write_seconds = time.perf_counter() - start
        _test_pause(save.step)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it at the commit
        save.error = exc


def _test_pause(step) -> None:
    wanted = os.environ.get(PAUSE_ENV)
    if wanted:
        at, seconds = wanted.split(":")
        if step == int(at):
            time.sleep(float(seconds))


def _commit(save: _Save) -> int:
    """Every rank: agree that every file is written, then rank 0 commits the index."""
    comm, root = save.comm, save.root
    try:
        _agree(comm, save.error, f"writing {root / save.name}")
        total = committed = 0
        error = None
        if comm.rank == 0:
            try:
                index = _build_index(root, save.generation, comm.world_size, save.step,
                                     save.extra, save.save_id)
                total = sum(index.files.values())
                files.write_index(root, index)
                committed = 1
                if save.asynchronous:
                    _clean_up_later(save)
                else:
                    files.remove_superseded(root, save.generation)
            except Exception as exc:  # noqa: BLE001
                error = exc
                if not committed:       # ours alone (reserved under the lock): nothing names it
                    shutil.rmtree(files.generation_dir(root, save.generation), ignore_errors=True)
        _agree(comm, error, f"committing {root / files.INDEX}")
        (total,) = _from_rank0(comm, [total])
    finally:
        save.release()
    return total


def _build_index(root: Path, generation: int, world: int, step, extra,
                 save_id: str) -> files.Index:
    tensors: dict[str, files.TensorRecord] = {}
    sizes = {}
    for rank in range(world):
        name = files.rank_file(generation, rank)
        sizes[name] = (root / name).stat().st_size
        for key, piece in files.read_rank_pieces(root, name, save_id).items():
            record = tensors.setdefault(key, files.TensorRecord(tuple(piece["shape"]),
                                                                piece["dtype"]))
            if record.shape != tuple(piece["shape"]) or record.dtype != piece["dtype"]:
                raise CheckpointError(f"{key}: rank {rank} saved it as {piece['dtype']} "
                                      f"{tuple(piece['shape'])}, another rank as {record.dtype} "
                                      f"{record.shape}")
            record.pieces.append(files.Piece(name, Box(tuple(piece["offsets"]),
                                                       tuple(piece["lengths"])),
                                             piece["checksum"]))
    for key, record in tensors.items():
        check_cover(key, record.shape, [p.box for p in record.pieces])
    return files.Index(generation, step, extra, world, tensors, sizes, save_id)


def _result(save: _Save, total: int, blocked: float, asynchronous: bool) -> SaveResult:
    result = SaveResult(str(save.root), save.step, save.generation, save.written, total,
                        time.perf_counter() - save.start, blocked, asynchronous,
                        save.write_seconds)
    logger.info("checkpoint saved to %s (generation %d, save %s%s): %d bytes on this rank, %d "
                "in all, %.2f s (%.2f s blocked)", save.root, save.generation, save.save_id,
                ", in the background" if asynchronous else "", save.written, total,
                result.seconds, blocked)
    return result


class AsyncSave:
    """A save whose file is being written in the background (``save(..., async_save=True)``),
    as PyTorch DCP's ``async_save`` returns a future. :meth:`wait` commits it: collective, every
    rank calls it at the same point (or reaches another wait point: the next save, a load,
    :func:`wait`)."""

    def __init__(self, save: _Save, arrays: dict, pieces: dict, blocked: float):
        self._save = save
        self._blocked = blocked
        self._result: Optional[SaveResult] = None
        self._failure: Optional[BaseException] = None
        self._thread = threading.Thread(target=_write, args=(save, arrays, pieces),
                                        name=f"checkpoint-save {save.root}", daemon=False)
        self._thread.start()

    @property
    def path(self) -> str:
        return str(self._save.root)

    @property
    def step(self) -> Optional[int]:
        return self._save.step

    def done(self) -> bool:
        """Whether this rank's file is written (the save is committed only by :meth:`wait`)."""
        return not self._thread.is_alive()

    def committed(self) -> bool:
        return self._result is not None

    def wait(self) -> SaveResult:
        """Wait for this rank's write, then commit the save on every rank; the result, or the
        :class:`CheckpointError` of a failed write (naming the file), again on a later call."""
        global _PENDING
        if self._result is not None:
            return self._result
        if self._failure is not None:
            raise self._failure
        if _PENDING is self:
            _PENDING = None
        started = time.perf_counter()
        try:
            self._thread.join()
            total = _commit(self._save)
        except BaseException as exc:
            self._save.release()
            self._failure = exc
            raise
        blocked = self._blocked + time.perf_counter() - started
        self._result = _result(self._save, total, blocked, asynchronous=True)
        return self._result


_PENDING: Optional[AsyncSave] = None
_CLEANUP: Optional[threading.Thread] = None


def _clean_up_later(save: _Save) -> None:
    """Rank 0, after an asynchronous save committed: remove the generations it superseded on a
    background thread (removing a large file takes a while: 0.2-0.3 s for 512 MiB per rank on
    the 2-core machine), under the directory's lock, which that thread releases when done (the
    cleanup is part of the save for a second writer); no collective."""
    global _CLEANUP
    lock, save.lock = save.lock, None

    def clean() -> None:
        try:
            files.remove_superseded(save.root, save.generation)
        finally:
            if lock is not None:
                lock.__exit__(None, None, None)
    _CLEANUP = threading.Thread(target=clean, name=f"checkpoint-cleanup {save.root}")
    _CLEANUP.start()


def _join_cleanup() -> None:
    """Before this process locks a directory again: its last cleanup holds the lock."""
    global _CLEANUP
    if _CLEANUP is not None:
        _CLEANUP.join()
        _CLEANUP = None


def pending() -> Optional[AsyncSave]:
    """The asynchronous save not yet committed in this process, if any."""
    return _PENDING


def wait() -> Optional[SaveResult]:
    """Commit the pending asynchronous save, if there is one (collective: every rank calls it);
    its result, or None. Raises its :class:`CheckpointError` when its write failed."""
    return _PENDING.wait() if _PENDING is not None else None


def commit_ready(written_everywhere: Optional[bool] = None) -> Optional[SaveResult]:
    """Commit the pending asynchronous save if every rank's write has finished, else leave it
    running; its result, or None. Collective: every rank calls it at the same point (a training
    loop, after every step), and all of them commit or none. ``written_everywhere``: whether every
    rank's ``pending().done()`` was true, when the caller already learned it in a collective of
    its own (``gradpool train`` rides it on its per-step exchange); None asks the ranks with one
    small all-reduce. The commits happen on the caller's thread, where every collective of the
    program runs in the same order on every rank: a background thread cannot run one next to the
    training's."""
    if _PENDING is None:
        return None
    if written_everywhere is None:
        comm = _PENDING._save.comm
        written = all_sum_ints(comm, [_PENDING.done()])[0]
        written_everywhere = written == comm.world_size
    return _PENDING.wait() if written_everywhere else None


@atexit.register
def _warn_uncommitted() -> None:
    if _PENDING is not None and not _PENDING.committed():
        logger.warning("checkpoint %s (step %s) was saved asynchronously and never committed "
                       "(no wait point reached before the process ended): it is not loadable; "
                       "call hyper_parallel.checkpoint.wait() on every rank before exiting",
                       _PENDING.path, _PENDING.step)


def save(path, model, optimizer=None, *, step: Optional[int] = None, extra: Any = None,
         async_save: bool = False):
    """Save ``model`` (and ``optimizer``'s states) to the directory ``path``; every rank calls it.
    A second writer saving into the same directory meanwhile gets a :class:`CheckpointError`
    naming the holder of the directory's lock. Commits a pending asynchronous save first.

    Returns a :class:`SaveResult`; with ``async_save`` an :class:`AsyncSave` as soon as the state
    is copied to host memory (see the module docstring for when it is committed)."""
    root = _check_save_args(path, step, extra)
    check_bool("async_save", async_save)
    wait()
    _join_cleanup()
    start = time.perf_counter()
    entries = entries_of(model, optimizer)
    save_ = _prepare(root, step, extra, start)
    save_.asynchronous = async_save
    arrays = pieces = None
    try:
        arrays, pieces = _snapshot(entries, copy=async_save)
    except Exception as exc:  # noqa: BLE001 - every rank hears of it at the commit
        save_.error = exc
    if async_save:
        global _PENDING
        _PENDING = AsyncSave(save_, arrays, pieces, time.perf_counter() - start)
        return _PENDING
    _write(save_, arrays, pieces)
    total = _commit(save_)
    return _result(save_, total, time.perf_counter() - start, asynchronous=False)
