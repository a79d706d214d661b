"""Distributed load and export: every rank loads only the slices it needs, at any world size or
mesh (see :mod:`hyper_parallel.checkpoint.files` for the files on disk, and
:mod:`hyper_parallel.checkpoint.saving` for the save, synchronous or asynchronous).

Every rank of the world calls :func:`load` with the same path (a file system all ranks share).
A pending asynchronous save of this process is committed first (a wait point).
"""
from __future__ import annotations

import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Optional

import numpy as np

from gradpool import CheckpointError, StateMismatchError, check_bool, communicator_for
from hyper_parallel.checkpoint import files, saving
from hyper_parallel.checkpoint.saving import MODEL, OPTIMIZER, checked_path, entries_of
from hyper_parallel.core.dtensor.boxes import Box, plan_reads
from hyper_parallel.core.fully_shard.held_by_some import world_keys
from hyper_parallel.core.fully_shard.state_dict import assemble

logger = logging.getLogger(__name__)


def _check_fits(index: files.Index, entries, optimizer, root: Path, wanted: set) -> None:
    """``wanted``: the keys some rank of the world needs (an expert another rank holds is not
    unexpected here)."""
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


def _read_state(root: Path, index: files.Index, entries, optimizer, verify: bool,
                wanted: set):
    """Every value this rank needs from ``index``'s checkpoint, every piece checked first; the
    model is not touched."""
    _check_fits(index, entries, optimizer, root, wanted)
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


def _read_with_retries(root: Path, entries, optimizer, verify: bool, comm, wanted: set):
    index = files.read_index(root)
    for attempt in range(_LOAD_ATTEMPTS):
        try:
            reader, values_of = _read_state(root, index, entries, optimizer, verify, wanted)
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
    failed = saving.ranks_failing(comm, error)
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
    root = checked_path(path)
    saving.wait()
    start = time.perf_counter()
    comm = communicator_for()
    entries = entries_of(model, optimizer)
    wanted = set(world_keys({key: (e.global_shape, e.dtype) for key, e in entries}, comm))
    index = reader = values_of = error = None
    try:
        index, reader, values_of = _read_with_retries(root, entries, optimizer, verify, comm,
                                                      wanted)
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
