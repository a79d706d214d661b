"""The files of a distributed checkpoint: one safetensors file per rank and one JSON index.

Layout of a checkpoint directory::

    index.json                       the commit point: which files hold which piece of what
    gen-00000007/rank-00000.safetensors
    gen-00000007/rank-00001.safetensors

Each save writes a new generation directory; the index naming it is written to a temporary name,
flushed and renamed over the old one (an atomic rename on POSIX), and only then are older
generations removed. A save killed at any point leaves either the old index with its untouched
files, or the new one with all of its files. Each rank file carries, in its safetensors metadata,
the global shape and offsets of every piece in it, so the index is built from the files
themselves.

Why the safetensors library (not MindSpore's ``save_checkpoint(format="safetensors")``): its
``safe_open(...).get_slice`` reads a part of one tensor from a memory-mapped file, so a rank
loads only the slices it needs; it checks that a file's header and length agree (a truncated file
is refused) and it writes NumPy arrays, bfloat16 included through ``ml_dtypes``, without a device.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from gradpool import CheckpointError
from hyper_parallel.core.dtensor.boxes import Box

INDEX = "index.json"
FORMAT = "gradpool-distributed-checkpoint"
VERSION = 1
_PIECES_KEY = "gradpool.pieces"
_GENERATION_PREFIX = "gen-"
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
           "float64": np.float64, "int32": np.int32, "int64": np.int64, "int8": np.int8,
           "uint8": np.uint8, "bool": np.bool_}


def numpy_dtype(name: str):
    if name not in _DTYPES:
        raise CheckpointError(f"dtype {name!r} cannot be saved; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class Piece:
    file: str          # relative to the checkpoint directory
    box: Box


@dataclass
class TensorRecord:
    shape: tuple[int, ...]
    dtype: str
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Index:
    generation: int
    step: Optional[int]
    extra: Any
    world_size: int
    tensors: dict[str, TensorRecord]
    files: dict[str, int]           # relative path -> size in bytes

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "generation": self.generation,
                "step": self.step, "extra": self.extra, "world_size": self.world_size,
                "files": self.files,
                "tensors": {key: {"shape": list(r.shape), "dtype": r.dtype,
                                  "pieces": [{"file": p.file, "offsets": list(p.box.offsets),
                                              "lengths": list(p.box.lengths)} for p in r.pieces]}
                            for key, r in self.tensors.items()}}

    @classmethod
    def from_json(cls, data: dict, where: Path) -> "Index":
        try:
            if data.get("format") != FORMAT or data.get("version") != VERSION:
                raise CheckpointError(
                    f"{where} is not a version-{VERSION} {FORMAT} index (format "
                    f"{data.get('format')!r}, version {data.get('version')!r})")
            tensors = {key: TensorRecord(tuple(r["shape"]), r["dtype"],
                                         [Piece(p["file"], Box(tuple(p["offsets"]),
                                                               tuple(p["lengths"])))
                                          for p in r["pieces"]])
                       for key, r in data["tensors"].items()}
            return cls(int(data["generation"]), data["step"], data.get("extra"),
                       int(data["world_size"]), tensors,
                       {name: int(size) for name, size in data["files"].items()})
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{where} is not a valid checkpoint index: {type(exc).__name__} "
                                  f"{exc}") from exc


def generation_dir(root: Path, generation: int) -> Path:
    return root / f"{_GENERATION_PREFIX}{generation:08d}"


def rank_file(generation: int, rank: int) -> str:
    return f"{_GENERATION_PREFIX}{generation:08d}/rank-{rank:05d}.safetensors"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(tmp: Path, final: Path) -> None:
    """Flush ``tmp`` to disk and rename it to ``final`` (atomic), then flush the directory."""
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


def write_single_file(final: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> int:
    """Write one safetensors file under a temporary name and rename it; its size in bytes."""
    tmp = final.with_name(final.name + ".tmp")
    try:
        save_file(arrays, str(tmp), metadata=metadata)
        _commit(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final.stat().st_size


def write_rank_file(root: Path, name: str, arrays: dict[str, np.ndarray],
                    pieces: dict[str, dict]) -> int:
    """Write one rank's pieces to ``root/name``; its size in bytes."""
    return write_single_file(root / name, arrays, {_PIECES_KEY: json.dumps(pieces)})


def read_rank_pieces(root: Path, name: str) -> dict[str, dict]:
    """The pieces a rank file says it holds: ``{key: {shape, dtype, offsets, lengths}}``."""
    path = root / name
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            keys = set(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc
    try:
        pieces = json.loads(metadata[_PIECES_KEY])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} has no valid piece table") from exc
    if set(pieces) != keys:
        raise CheckpointError(f"checkpoint file {path}: its piece table names other tensors "
                              "than it holds")
    return pieces


def write_index(root: Path, index: Index) -> None:
    tmp = root / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index.to_json(), indent=1, sort_keys=True))
    _commit(tmp, root / INDEX)


def read_index(root: Path) -> Index:
    path = root / INDEX
    if not path.is_file():
        raise CheckpointError(f"{root} holds no checkpoint: {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint index {path} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"checkpoint index {path} is not a JSON object")
    return Index.from_json(data, path)


def latest_generation(root: Path) -> int:
    """The highest generation in ``root``, committed or left by an interrupted save (0: none)."""
    numbers = [0]
    for child in root.glob(f"{_GENERATION_PREFIX}*"):
        suffix = child.name[len(_GENERATION_PREFIX):]
        if suffix.isdigit():
            numbers.append(int(suffix))
    return max(numbers)


def remove_generations_except(root: Path, keep: int) -> None:
    for child in root.glob(f"{_GENERATION_PREFIX}*"):
        if child.is_dir() and child.name != generation_dir(root, keep).name:
            shutil.rmtree(child, ignore_errors=True)


class PieceReader:
    """Reads parts of saved pieces, each file opened (memory-mapped) once and checked first."""

    def __init__(self, root: Path, index: Index):
        self.root, self.index = root, index
        self._open: dict[str, Any] = {}
        self.bytes_read = 0

    def open(self, name: str):
        handle = self._open.get(name)
        if handle is not None:
            return handle
        path = self.root / name
        expected = self.index.files.get(name)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {path} is missing: {exc}") from exc
        if expected is not None and size != expected:
            raise CheckpointError(f"checkpoint file {path} is {size} bytes; the index records "
                                  f"{expected} (truncated or overwritten)")
        try:
            handle = safe_open(str(path), framework="numpy")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc
        self._open[name] = handle
        return handle

    def read(self, key: str, piece: Piece, part: Box) -> np.ndarray:
        """``part`` (a box inside ``piece.box``) of ``key``'s piece."""
        handle = self.open(piece.file)
        try:
            sliced = handle.get_slice(key)
            if tuple(sliced.get_shape()) != piece.box.lengths:
                raise CheckpointError(
                    f"checkpoint file {self.root / piece.file}: {key} has shape "
                    f"{tuple(sliced.get_shape())}, the index records {piece.box.lengths}")
            values = sliced[part.slices(piece.box)] if part.lengths else sliced[...]
        except SafetensorError as exc:
            raise CheckpointError(f"checkpoint file {self.root / piece.file}: {key} cannot be "
                                  f"read: {exc}") from exc
        values = np.asarray(values).reshape(part.lengths)
        if values.dtype.name == "bfloat16" and values.dtype != ml_dtypes.bfloat16:
            # safetensors names the dtype: another registered bfloat16 (MindSpore's) may answer
            values = values.view(np.uint16).view(ml_dtypes.bfloat16)
        self.bytes_read += values.nbytes
        return values
