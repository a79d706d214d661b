"""Distributed save and load: every rank writes its own shards, and loads only the slices it needs,
at any world size or mesh (see :mod:`hyper_parallel.checkpoint.files` for the files on disk).

Every rank of the world calls :func:`save` and :func:`load` with the same path (a file system all
ranks share). Saving runs three barriers (small all-reduces over the world): rank 0 prepares the
generation directory, every rank writes its file, rank 0 reads the files' piece tables, checks
that every tensor is covered exactly once and commits the index. A rank that fails makes every
rank raise :class:`gradpool.CheckpointError`, and the previous checkpoint stays the loadable one.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mindspore as ms
import numpy as np

from gradpool import (CheckpointError, InvalidArgumentError, StateMismatchError,
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
        json.dumps(extra)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"extra must be JSON-serialisable (it goes into the index): "
                                   f"{exc}") from exc
    return root


def save(path, model, optimizer=None, *, step: Optional[int] = None, extra: Any = None) -> SaveResult:
    """Save ``model`` (and ``optimizer``'s states) to the directory ``path``; every rank calls it."""
    root = _check_save_args(path, step, extra)
    start = time.perf_counter()
    comm = communicator_for()
    entries = _entries(model, optimizer)
    error = generation = None
    if comm.rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            generation = files.latest_generation(root) + 1
            target = files.generation_dir(root, generation)
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir()
        except OSError as exc:
            error = exc
    _agree(comm, error, f"preparing {root}")
    generation = int(_all_sum(comm, float(generation or 0)))

    name = files.rank_file(generation, comm.rank)
    arrays, pieces = {}, {}
    written = 0
    try:
        for key, entry in entries:
            if entry.writes:
                arrays[key] = entry.local_values(copy=False)    # read before save returns
                pieces[key] = {"shape": list(entry.global_shape), "dtype": entry.dtype,
                               "offsets": list(entry.box.offsets),
                               "lengths": list(entry.box.lengths)}
        written = files.write_rank_file(root, name, arrays, pieces)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        error = exc
    _agree(comm, error, f"writing {root / name}")

    total = 0
    if comm.rank == 0:
        try:
            index = _build_index(root, generation, comm.world_size, step, extra)
            total = sum(index.files.values())
            files.write_index(root, index)
            files.remove_generations_except(root, generation)
        except Exception as exc:  # noqa: BLE001
            error = exc
    _agree(comm, error, f"committing {root / files.INDEX}")
    total = int(_all_sum(comm, float(total)))
    result = SaveResult(str(root), step, generation, written, total, time.perf_counter() - start)
    logger.info("checkpoint saved to %s (generation %d): %d bytes on this rank, %d in all, %.2f s",
                root, generation, written, total, result.seconds)
    return result


def _build_index(root: Path, generation: int, world: int, step, extra) -> files.Index:
    tensors: dict[str, files.TensorRecord] = {}
    sizes = {}
    for rank in range(world):
        name = files.rank_file(generation, rank)
        sizes[name] = (root / name).stat().st_size
        for key, piece in files.read_rank_pieces(root, name).items():
            record = tensors.setdefault(key, files.TensorRecord(tuple(piece["shape"]),
                                                                piece["dtype"]))
            if record.shape != tuple(piece["shape"]) or record.dtype != piece["dtype"]:
                raise CheckpointError(f"{key}: rank {rank} saved it as {piece['dtype']} "
                                      f"{tuple(piece['shape'])}, another rank as {record.dtype} "
                                      f"{record.shape}")
            record.pieces.append(files.Piece(name, Box(tuple(piece["offsets"]),
                                                       tuple(piece["lengths"]))))
    for key, record in tensors.items():
        check_cover(key, record.shape, [p.box for p in record.pieces])
    return files.Index(generation, step, extra, world, tensors, sizes)


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


def load(path, model, optimizer=None) -> dict:
    """Load a checkpoint saved at any world size or mesh into ``model`` (and ``optimizer``);
    every rank calls it and reads only the slices it holds. Returns ``{"step", "extra",
    "bytes_read", "seconds"}``. The model is unchanged when the checkpoint does not fit."""
    root = _checked_path(path)
    start = time.perf_counter()
    index = files.read_index(root)
    entries = _entries(model, optimizer)
    _check_fits(index, entries, optimizer, root)
    reader = files.PieceReader(root, index)
    planned = []
    for key, entry in entries:
        record = index.tensors[key]
        reads = plan_reads(key, record.shape, entry.box, [p.box for p in record.pieces])
        for piece_index, _ in reads:
            reader.open(record.pieces[piece_index].file)     # every file checked before a write
        planned.append((key, entry, record, reads))
    values_of = [(entry, _read_box(reader, key, record, entry.box, reads))
                 for key, entry, record, reads in planned]
    for entry, values in values_of:
        entry.assign(values)
    seconds = time.perf_counter() - start
    logger.info("checkpoint loaded from %s (step %s): %d bytes read on this rank, %.2f s", root,
                index.step, reader.bytes_read, seconds)
    return {"step": index.step, "extra": index.extra, "bytes_read": reader.bytes_read,
            "seconds": seconds}


def export_full(checkpoint, out) -> dict:
    """Write the model of the checkpoint in ``checkpoint`` as one safetensors file ``out`` under
    the unsharded model's parameter names (no launch: reads the files directly). Holds the whole
    model in memory: for inference-sized exports. Returns ``{"tensors", "bytes", "seconds"}``."""
    start = time.perf_counter()
    root = Path(checkpoint)
    index = files.read_index(root)
    reader = files.PieceReader(root, index)
    arrays = {}
    for key, record in index.tensors.items():
        if not key.startswith(MODEL):
            continue
        whole = Box.whole(record.shape)
        reads = plan_reads(key, record.shape, whole, [p.box for p in record.pieces])
        arrays[key[len(MODEL):]] = _read_box(reader, key, record, whole, reads)
    if not arrays:
        raise CheckpointError(f"checkpoint {root} holds no model tensors")
    out = Path(out)
    if out.is_dir():
        raise CheckpointError(f"export target {out} is a directory; name the file to write")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        size = files.write_single_file(out, arrays, {"step": json.dumps(index.step)})
    except (OSError, files.SafetensorError) as exc:
        raise CheckpointError(f"export target {out} cannot be written: {exc}") from exc
    return {"tensors": len(arrays), "bytes": size, "seconds": time.perf_counter() - start}
