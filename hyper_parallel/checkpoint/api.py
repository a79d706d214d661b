"""Distributed save and load: every rank writes its own shards, and loads only the slices it needs,
at any world size or mesh (see :mod:`hyper_parallel.checkpoint.files` for the files on disk).

Every rank of the world calls :func:`save` and :func:`load` with the same path (a file system all
ranks share). Saving runs three barriers (small all-reduces over the world): rank 0 locks the
directory (one writer at a time), reserves a new generation directory and draws the save's id,
every rank writes its file, rank 0 reads the files' piece tables, checks that every tensor is
covered exactly once and commits the index. A rank that fails makes every rank raise
:class:`gradpool.CheckpointError`, and the previous checkpoint stays the loadable one.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mindspore as ms
import numpy as np

from gradpool import (CheckpointError, InvalidArgumentError, StateMismatchError, check_bool,
                      communicator_for)
from hyper_parallel.checkpoint import files
from hyper_parallel.core.dtensor.boxes import Box, check_cover, plan_reads
from hyper_parallel.core.fully_shard.state_dict import (StateEntry, assemble, model_entries,
                                                        optimizer_entries)

logger = logging.getLogger(__name__)
MODEL, OPTIMIZER = "model/", "optimizer/"


@dataclass(frozen=True)
class SaveResult:
    path: str
    step: Optional[int]
    generation: int
    bytes_written: int         # by this rank
    total_bytes: int           # by every rank (the sizes the index records)
    seconds: float


def _entries(model, optimizer) -> list[tuple[str, StateEntry]]:
    entries = [(MODEL + e.name, e) for e in model_entries(model)]
    if optimizer is not None:
        entries += [(OPTIMIZER + e.name, e) for e in optimizer_entries(model, optimizer)]
    return entries


def _all_sum(comm, value: float) -> float:
    """Sum of ``value`` over the world: the barrier every step of a save waits at."""
    if comm.world_size == 1:
        return value
    buf = ms.Tensor(np.array([value], np.float32))
    comm.all_reduce(buf, op="sum").wait()
    return float(buf.asnumpy()[0])


def _from_rank0(comm, values: list[int]) -> list[int]:
    """Rank 0's non-negative ``values`` (each below 2**64) on every rank, exactly: each travels as
    four 16-bit limbs in a float32 all-reduce to which only rank 0 adds (float32 holds integers
    exactly only below 2**24, so a generation, a byte count or a 64-bit id sent whole would not
    arrive intact)."""
    if comm.world_size == 1:
        return list(values)
    limbs = np.zeros(4 * len(values), np.float32)
    if comm.rank == 0:
        for i, value in enumerate(values):
            for j in range(4):
                limbs[4 * i + j] = (value >> (16 * j)) & 0xFFFF
    buf = ms.Tensor(limbs)
    comm.all_reduce(buf, op="sum").wait()
    got = buf.asnumpy()
    return [sum(int(got[4 * i + j]) << (16 * j) for j in range(4)) for i in range(len(values))]


def _agree(comm, error: Optional[BaseException], what: str) -> None:
    """Every rank raises if any rank failed ``what`` (so none goes on to the next barrier)."""
    failed = _all_sum(comm, 0.0 if error is None else 1.0)
    if error is not None:
        raise CheckpointError(f"checkpoint save: {what} failed on rank {comm.rank}: "
                              f"{type(error).__name__}: {error}") from error
    if failed:
        raise CheckpointError(f"checkpoint save: {what} failed on {int(failed)} other rank(s); "
                              "see their logs; the previous checkpoint is unchanged")


def _checked_path(path) -> Path:
    if not isinstance(path, (str, Path)) or not str(path):
        raise InvalidArgumentError(f"checkpoint path must be a non-empty str or Path, got {path!r}")
    return Path(path)


def _check_save_args(path, step, extra) -> Path:
    root = _checked_path(path)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise InvalidArgumentError(f"step must be an int >= 0 or None, got {step!r}")
    try:
        # strict JSON: NaN and infinities would make an index other JSON readers refuse
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"extra must be strict JSON (it goes into the index; no NaN "
                                   f"or infinity, no objects): {exc}") from exc
    return root


def save(path, model, optimizer=None, *, step: Optional[int] = None, extra: Any = None) -> SaveResult:
    """Save ``model`` (and ``optimizer``'s states) to the directory ``path``; every rank calls it.
    A second writer saving into the same directory meanwhile gets a :class:`CheckpointError`
    naming the holder of the directory's lock."""
    root = _check_save_args(path, step, extra)
    start = time.perf_counter()
    comm = communicator_for()
    entries = _entries(model, optimizer)
    lock = None
    try:
        error = generation = save_id = None
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
        save_id_text = files.save_id_text(save_id)
        written = _write_own_file(comm, root, generation, save_id_text, entries)
        total = committed = 0
        if comm.rank == 0:
            try:
                index = _build_index(root, generation, comm.world_size, step, extra, save_id_text)
                total = sum(index.files.values())
                files.write_index(root, index)
                committed = 1
                files.remove_superseded(root, generation)
            except Exception as exc:  # noqa: BLE001
                error = exc
                if not committed:       # ours alone (reserved under the lock): nothing names it
                    shutil.rmtree(files.generation_dir(root, generation), ignore_errors=True)
        _agree(comm, error, f"committing {root / files.INDEX}")
        (total,) = _from_rank0(comm, [total])
    finally:
        if lock is not None:
            lock.__exit__(None, None, None)
    result = SaveResult(str(root), step, generation, written, total, time.perf_counter() - start)
    logger.info("checkpoint saved to %s (generation %d, save %s): %d bytes on this rank, %d in "
                "all, %.2f s", root, generation, save_id_text, written, total, result.seconds)
    return result


def _write_own_file(comm, root: Path, generation: int, save_id: str, entries) -> int:
    """This rank's file of the save; every rank hears if any rank's write failed."""
    name = files.rank_file(generation, comm.rank)
    arrays, pieces = {}, {}
    written, error = 0, None
    try:
        for key, entry in entries:
            if entry.writes:
                arrays[key] = entry.local_values(copy=False)    # read before save returns
                pieces[key] = {"shape": list(entry.global_shape), "dtype": entry.dtype,
                               "offsets": list(entry.box.offsets),
                               "lengths": list(entry.box.lengths)}
        written = files.write_rank_file(root, name, arrays, pieces, save_id)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    _agree(comm, error, f"writing {root / name}")
    return written


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


def _check_fits(index: files.Index, entries, optimizer, root: Path) -> None:
    wanted = {key for key, _ in entries}
    for key, entry in entries:
        record = index.tensors.get(key)
        if record is None:
            raise StateMismatchError(f"checkpoint {root} has no {key!r}; the model (or optimizer) "
                                     "needs it")
        if record.shape != entry.global_shape or record.dtype != entry.dtype:
            raise StateMismatchError(
                f"checkpoint {root}: {key!r} is {record.dtype} of shape {record.shape}; the "
                f"model's is {entry.dtype} of shape {entry.global_shape}")
    for key in index.tensors:
        in_scope = key.startswith(MODEL) or (optimizer is not None and key.startswith(OPTIMIZER))
        if in_scope and key not in wanted:
            raise StateMismatchError(f"checkpoint {root} has {key!r}, which the model (or "
                                     "optimizer) does not have")


def _read_box(reader: files.PieceReader, key: str, record: files.TensorRecord, box: Box,
              reads: list) -> np.ndarray:
    """``box`` of ``key``, read from the checkpoint's pieces ``plan_reads`` chose."""
    return assemble(box, reads, lambda index, part: reader.read(key, record.pieces[index], part),
                    files.numpy_dtype(record.dtype))


def _reader(root: Path, index: files.Index, verify: bool) -> files.PieceReader:
    check_bool("verify", verify)
    if not verify:      # an opt-out is said, never silent
        logger.warning("checkpoint %s: checksums not verified (verify=False: trusted storage); "
                       "sizes, save ids, dtypes and shapes still are", root)
    return files.PieceReader(root, index, verify=verify)


_LOAD_ATTEMPTS = 5


def _index_or_none(root: Path) -> Optional[files.Index]:
    try:
        return files.read_index(root)
    except CheckpointError:
        return None


def _read_state(root: Path, index: files.Index, entries, optimizer, verify: bool):
    """Every value this rank needs from ``index``'s checkpoint, every piece checked first; the
    model is not touched."""
    _check_fits(index, entries, optimizer, root)
    reader = _reader(root, index, verify)
    try:
        planned = []
        for key, entry in entries:
            record = index.tensors[key]
            reads = plan_reads(key, record.shape, entry.box, [p.box for p in record.pieces])
            for piece_index, _ in reads:
                reader.check(key, record.pieces[piece_index])    # every piece before a read
            planned.append((key, entry, record, reads))
        return reader, [(entry, _read_box(reader, key, record, entry.box, reads))
                        for key, entry, record, reads in planned]
    finally:
        reader.close()


def _read_with_retries(root: Path, entries, optimizer, verify: bool, comm):
    index = files.read_index(root)
    for attempt in range(_LOAD_ATTEMPTS):
        try:
            reader, values_of = _read_state(root, index, entries, optimizer, verify)
            return index, reader, values_of
        except CheckpointError:
            # A writer may have committed a newer save, and removed this one's files, between
            # the read of the index and the opening of the files: then read the newer one. In
            # one process only: ranks that each switched on their own could load two saves.
            newer = _index_or_none(root)
            if (attempt + 1 == _LOAD_ATTEMPTS or newer is None or newer.save_id == index.save_id
                    or comm.world_size != 1):
                raise
            logger.info("checkpoint %s: save %s was replaced by save %s while loading; "
                        "loading that one", root, index.save_id, newer.save_id)
            index = newer
    raise AssertionError("unreachable: the last attempt returns or raises")


def _agree_to_assign(comm, error: Optional[BaseException], root: Path) -> None:
    """Raise on every rank if any rank could not read its part, before any rank changes its
    model: a file only some ranks read (their own shards) must not leave the others loaded."""
    failed = _all_sum(comm, 0.0 if error is None else 1.0) if comm.world_size > 1 else 0.0
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"checkpoint {root} failed to load on {int(failed)} other rank(s) "
                              "(their logs say why); this rank's model and optimizer are "
                              "unchanged")


def load(path, model, optimizer=None, *, verify: bool = True) -> dict:
    """Load a checkpoint saved at any world size or mesh into ``model`` (and ``optimizer``);
    every rank calls it and reads only the slices it holds. Returns ``{"step", "extra",
    "bytes_read", "seconds"}``. The model is unchanged when the checkpoint does not fit or a
    file fails its checks: its size, save id, each piece's dtype and shape, and (``verify``,
    the default) the checksum of every piece this rank reads from."""
    root = _checked_path(path)
    start = time.perf_counter()
    comm = communicator_for()
    entries = _entries(model, optimizer)
    index = reader = values_of = error = None
    try:
        index, reader, values_of = _read_with_retries(root, entries, optimizer, verify, comm)
    except Exception as exc:  # noqa: BLE001 - the other ranks must hear of it before assigning
        error = exc
    _agree_to_assign(comm, error, root)
    for entry, values in values_of:
        entry.assign(values)
    seconds = time.perf_counter() - start
    logger.info("checkpoint loaded from %s (step %s): %d bytes read on this rank, %.2f s", root,
                index.step, reader.bytes_read, seconds)
    return {"step": index.step, "extra": index.extra, "bytes_read": reader.bytes_read,
            "seconds": seconds}


def export_full(checkpoint, out, *, verify: bool = True) -> dict:
    """Write the model of the checkpoint in ``checkpoint`` as one safetensors file ``out`` under
    the unsharded model's parameter names (no launch: reads the files directly). Holds the whole
    model in memory: for inference-sized exports. Every piece read is checked as :func:`load`
    checks it. ``out`` must end in ``.safetensors``, lie outside the checkpoint, and be new or a
    regular file. Returns ``{"tensors", "bytes", "seconds"}``."""
    start = time.perf_counter()
    root = Path(checkpoint)
    out = Path(out)
    _check_export_target(root, out)
    index = files.read_index(root)
    reader = _reader(root, index, verify)
    arrays = {}
    try:
        for key, record in index.tensors.items():
            if not key.startswith(MODEL):
                continue
            try:
                whole = Box.whole(record.shape)
                reads = plan_reads(key, record.shape, whole, [p.box for p in record.pieces])
                arrays[key[len(MODEL):]] = _read_box(reader, key, record, whole, reads)
            except (StateMismatchError, ValueError, TypeError) as exc:
                # the index's own geometry is wrong: a damaged index, not a model mismatch
                raise CheckpointError(f"checkpoint index {root / files.INDEX}: tensor {key}: "
                                      f"{exc}; the index is damaged: export another "
                                      "checkpoint") from exc
    finally:
        reader.close()
    if not arrays:
        raise CheckpointError(f"checkpoint {root} holds no model tensors")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        size = files.write_single_file(out, arrays, {"step": json.dumps(index.step)})
    except (OSError, files.SafetensorError) as exc:
        raise CheckpointError(f"export target {out} cannot be written: {exc}") from exc
    return {"tensors": len(arrays), "bytes": size, "seconds": time.perf_counter() - start}


def _check_export_target(root: Path, out: Path) -> None:
    """Refuse a target the export would damage or that plain MindSpore would not load: the write
    goes to a temporary file renamed over ``out``, so a symlink, FIFO or device there would be
    replaced by a regular file, and a target inside the checkpoint could replace its index or
    a rank file."""
    if out.is_dir():
        raise CheckpointError(f"export target {out} is a directory; name the file to write")
    if not out.name.endswith(".safetensors"):
        raise CheckpointError(
            f"export target {out} does not end in .safetensors, which "
            "mindspore.load_checkpoint(..., format=\"safetensors\") requires; name it "
            f"{out.name}.safetensors")
    try:
        mode = os.lstat(out).st_mode
    except (FileNotFoundError, NotADirectoryError):
        mode = None         # a new file (or one whose directory cannot be made: the write says)
    except OSError as exc:
        raise CheckpointError(f"export target {out} cannot be examined: {exc}") from exc
    if mode is not None and not stat.S_ISREG(mode):
        kind = ("a symbolic link" if stat.S_ISLNK(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a file")
        raise CheckpointError(f"export target {out} is {kind}: the export would replace it with "
                              "a regular file; give the path of a new or regular file")
    inside = root.resolve()
    target = out.parent.resolve() / out.name
    if target == inside or inside in target.parents:
        raise CheckpointError(f"export target {out} lies inside the checkpoint {root} being "
                              "exported, whose files it could replace; write it elsewhere")
