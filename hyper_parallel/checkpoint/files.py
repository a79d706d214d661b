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

Integrity: each piece's bytes carry an xxh3-64 checksum, computed from the array while saving
and recorded in the rank file's piece table and in the index; every rank file also records its
save's random id, which the index records too. A reader checks each file's size, save id, and
each piece's dtype, shape and (unless ``verify=False``) checksum against the index before any
of it reaches a model, so a flipped byte, a NaN written into a tensor, a rewritten header or a
file of another save is a :class:`CheckpointError` naming the file and the tensor. Index paths
must be this generation's rank files: nothing outside the checkpoint directory is ever opened.
Why xxh3-64 (the ``xxhash`` package) and not ``zlib.crc32``: measured on this project's machine,
xxh3-64 hashes ~17 GB/s against crc32's ~2.2 GB/s; a save writes ~0.3 GB/s, so crc32 alone
would add ~13 % to a save and xxh3-64 adds under 2 %.

Why the safetensors library (not MindSpore's ``save_checkpoint(format="safetensors")``): its
``safe_open(...).get_slice`` reads a part of one tensor from a memory-mapped file, so a rank
loads only the slices it needs; it checks that a file's header and length agree (a truncated file
is refused) and it writes NumPy arrays, bfloat16 included through ``ml_dtypes``, without a device.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import shutil
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import ml_dtypes
import numpy as np
import xxhash
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from gradpool import CheckpointError
from hyper_parallel.core.dtensor.boxes import Box

INDEX = "index.json"
FORMAT = "gradpool-distributed-checkpoint"
VERSION = 2
_PIECES_KEY = "gradpool.pieces"
_SAVE_ID_KEY = "gradpool.save_id"
CHECKSUM = "xxh3_64"
GENERATION_PREFIX = "gen-"
_RANK_FILE = re.compile(r"gen-(\d{8})/rank-(\d{5})\.safetensors")
# safetensors' names of the dtypes above (the header's "dtype")
_FILE_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                "int32": "I32", "int64": "I64", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_ITEMSIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I32": 4, "I64": 8, "I8": 1, "U8": 1,
              "BOOL": 1}
_MAX_HEADER_BYTES = 100 * 2**20      # safetensors' own limit on a header
_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
           "float64": np.float64, "int32": np.int32, "int64": np.int64, "int8": np.int8,
           "uint8": np.uint8, "bool": np.bool_}


def numpy_dtype(name: str):
    if name not in _DTYPES:
        raise CheckpointError(f"dtype {name!r} cannot be saved; supported: {', '.join(_DTYPES)}")
    return _DTYPES[name]


def checksum(array: np.ndarray) -> str:
    """The checksum of ``array``'s bytes as safetensors writes them (C order, native little
    endian): hex xxh3-64."""
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    return _hex(xxhash.xxh3_64_intdigest(flat))


def _hex(value: int) -> str:
    return f"{value:016x}"


def new_save_id() -> int:
    """A random 64-bit id for one save (in every rank file and in the index)."""
    return secrets.randbits(64)


def save_id_text(save_id: int) -> str:
    return _hex(save_id)


@dataclass(frozen=True)
class Piece:
    file: str          # relative to the checkpoint directory
    box: Box
    checksum: Optional[str] = None      # None only in a version-1 index (before checksums)


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
    save_id: Optional[str] = None   # None only in a version-1 index
    version: int = VERSION

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "generation": self.generation,
                "step": self.step, "extra": self.extra, "world_size": self.world_size,
                "save_id": self.save_id, "checksum": CHECKSUM, "files": self.files,
                "tensors": {key: {"shape": list(r.shape), "dtype": r.dtype,
                                  "pieces": [{"file": p.file, "offsets": list(p.box.offsets),
                                              "lengths": list(p.box.lengths),
                                              "checksum": p.checksum} for p in r.pieces]}
                            for key, r in self.tensors.items()}}

    @classmethod
    def from_json(cls, data: dict, where: Path) -> "Index":
        version = data.get("version")
        if data.get("format") != FORMAT or version not in (1, VERSION):
            raise CheckpointError(
                f"{where} is not a version-1 or version-{VERSION} {FORMAT} index (format "
                f"{data.get('format')!r}, version {version!r})")
        try:
            generation, world = int(data["generation"]), int(data["world_size"])
            sizes = data.get("files")
            if not isinstance(sizes, dict) or not sizes:
                raise CheckpointError(
                    f"checkpoint index {where} lists no rank files ('files' is {sizes!r}), so no "
                    "file size can be checked: it is damaged; load another checkpoint")
            for name in sizes:
                _check_name(name, where, None, generation, world)
            tensors = {}
            for key, r in data["tensors"].items():
                pieces = []
                for p in r["pieces"]:
                    if p["file"] not in sizes:
                        _check_name(p["file"], where, key)
                    if version == VERSION and not isinstance(p.get("checksum"), str):
                        raise CheckpointError(f"checkpoint index {where}: tensor {key} in "
                                              f"{p['file']} has no checksum")
                    pieces.append(Piece(p["file"], Box(tuple(p["offsets"]), tuple(p["lengths"])),
                                        p.get("checksum")))
                tensors[key] = TensorRecord(tuple(r["shape"]), r["dtype"], pieces)
            save_id = data.get("save_id") if version == VERSION else None
            if version == VERSION and not isinstance(save_id, str):
                raise CheckpointError(f"checkpoint index {where} records no save id")
            return cls(generation, data["step"], data.get("extra"), world, tensors,
                       {name: int(size) for name, size in sizes.items()}, save_id, version)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{where} is not a valid checkpoint index: {type(exc).__name__} "
                                  f"{exc}") from exc


def _check_name(name, where: Path, key: Optional[str], generation: Optional[int] = None,
                world: int = 0) -> None:
    """Index paths name this generation's rank files only (``gen-<N>/rank-<R>.safetensors``, R
    below the world size): an absolute path or ``..`` would make a reader open a file outside
    the checkpoint directory. With no ``generation``, ``name`` is refused (a piece naming a file
    the index does not list)."""
    found = _RANK_FILE.fullmatch(name) if isinstance(name, str) else None
    if found and generation is not None and int(found[1]) == generation and \
            int(found[2]) < world:
        return
    of = f" (tensor {key})" if key is not None else ""
    if not isinstance(name, str) or os.path.isabs(name) or ".." in Path(name).parts:
        why = "lies outside the checkpoint directory"
    elif generation is None:
        why = "is not among the index's files"
    else:
        why = "is not one of this generation's rank files (gen-<N>/rank-<R>.safetensors)"
    raise CheckpointError(f"checkpoint index {where}: file {name!r}{of} {why}; the index is "
                          "damaged or was edited: load another checkpoint")


def generation_dir(root: Path, generation: int) -> Path:
    return root / f"{GENERATION_PREFIX}{generation:08d}"


def rank_file(generation: int, rank: int) -> str:
    return f"{GENERATION_PREFIX}{generation:08d}/rank-{rank:05d}.safetensors"


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


def _tmp_name(final: Path) -> Path:
    """A temporary name no other writer uses (two writers sharing one would each rename the
    other's half-written file into place)."""
    return final.with_name(f"{final.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _new_file_mode() -> int:
    """The mode ``open()`` gives a new file under this process's umask (0644 under 022), read
    from ``/proc`` where it is there (setting the umask to read it is process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def write_single_file(final: Path, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> int:
    """Write one safetensors file under a temporary name and rename it; its size in bytes."""
    tmp = _tmp_name(final)
    try:
        save_file(arrays, str(tmp), metadata=metadata)
        os.chmod(tmp, _new_file_mode())     # safetensors creates its files 0600
        _commit(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final.stat().st_size


def write_rank_file(root: Path, name: str, arrays: dict[str, np.ndarray],
                    pieces: dict[str, dict], save_id: str) -> int:
    """Write one rank's pieces to ``root/name``, each piece's checksum into its entry of
    ``pieces`` (computed from the arrays, before the bytes leave memory); its size in bytes."""
    for key, array in arrays.items():
        pieces[key]["checksum"] = checksum(array)
    return write_single_file(root / name, arrays, {_PIECES_KEY: json.dumps(pieces),
                                                   _SAVE_ID_KEY: save_id})


def read_rank_pieces(root: Path, name: str, save_id: str) -> dict[str, dict]:
    """The pieces a rank file of save ``save_id`` says it holds: ``{key: {shape, dtype,
    offsets, lengths, checksum}}``; a file of another save is refused."""
    path = root / name
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            keys = set(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc
    if metadata.get(_SAVE_ID_KEY) != save_id:
        raise CheckpointError(f"checkpoint file {path} belongs to save "
                              f"{metadata.get(_SAVE_ID_KEY)!r}, not to this save {save_id!r}: "
                              "another writer replaced it")
    try:
        pieces = json.loads(metadata[_PIECES_KEY])
    except (KeyError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} has no valid piece table") from exc
    if set(pieces) != keys:
        raise CheckpointError(f"checkpoint file {path}: its piece table names other tensors "
                              "than it holds")
    return pieces


def write_index(root: Path, index: Index) -> None:
    tmp = _tmp_name(root / INDEX)
    try:
        tmp.write_text(json.dumps(index.to_json(), indent=1, sort_keys=True, allow_nan=False))
        _commit(tmp, root / INDEX)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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


def _generations(root: Path) -> list[int]:
    numbers = []
    for child in root.glob(f"{GENERATION_PREFIX}*"):
        suffix = child.name[len(GENERATION_PREFIX):]
        if suffix.isdigit():
            numbers.append(int(suffix))
    return numbers


def latest_generation(root: Path) -> int:
    """The highest generation in ``root``, committed or left by an interrupted save (0: none)."""
    return max(_generations(root), default=0)


def reserve_generation(root: Path) -> int:
    """A new generation directory in ``root``, created by this call and no other: ``mkdir`` fails
    when the directory exists, so two writers never share a generation (one takes the next)."""
    generation = latest_generation(root) + 1
    while True:
        try:
            generation_dir(root, generation).mkdir()
            return generation
        except FileExistsError:
            generation += 1


def remove_superseded(root: Path, generation: int) -> None:
    """Remove the generations older than the committed ``generation`` (the one it replaced and
    any an interrupted save left) and temporary index files a killed writer left. Called under
    the directory lock, so none of them is another writer's save in progress; a newer
    generation is never touched."""
    for number in _generations(root):
        if number < generation:
            shutil.rmtree(generation_dir(root, number), ignore_errors=True)
    for tmp in root.glob(f"{INDEX}.*.tmp"):
        tmp.unlink(missing_ok=True)


class DirectoryLock:
    """An exclusive lock on a checkpoint directory, held for one save (``flock`` on
    ``<dir>/.lock``; the kernel drops it when the holder dies, so a killed save leaves no stale
    lock). The file names the holder for a second writer's error."""

    NAME = ".lock"

    def __init__(self, root: Path, holder: str):
        self.path = root / self.NAME
        self.holder = holder
        self._fd: Optional[int] = None

    def __enter__(self) -> "DirectoryLock":
        import fcntl
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointError(
                f"checkpoint directory {self.path.parent} is being saved by another writer "
                f"({holder}); one directory takes one writer at a time: wait for it, or save "
                "elsewhere") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, self.holder.encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)          # closing the last descriptor releases the flock
            self._fd = None


def _holder(fd: int) -> str:
    """Who holds the lock on ``fd``'s file: the holder writes it just after taking the lock, so
    give it a moment when the file is still empty."""
    for _ in range(20):
        text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        if text:
            return text
        time.sleep(0.005)
    return "unknown: it has not said"


def _read_header(fh, path: Path, size: int, of: str = "") -> tuple[dict, int]:
    """A safetensors file's header and where its data starts (8-byte little-endian length, then
    that much JSON), read from the open file ``fh``."""
    try:
        prefix = os.pread(fh.fileno(), 8, 0)
        if len(prefix) < 8:
            raise ValueError("shorter than a safetensors header")
        length = struct.unpack("<Q", prefix)[0]
        if length > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length {length} does not fit the file")
        header = json.loads(os.pread(fh.fileno(), length, 8))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read{of}: {exc}") from exc
    return header, 8 + length


class PieceReader:
    """Reads parts of saved pieces, each file opened (memory-mapped) once and checked first:
    its size and save id against the index, each piece's dtype, shape and byte length against
    the index and the header, and (``verify``) each piece's checksum, before any value is
    returned."""

    def __init__(self, root: Path, index: Index, verify: bool = True):
        if verify and index.version < VERSION:
            raise CheckpointError(
                f"checkpoint {root} was saved before checkpoints carried checksums (index "
                f"version {index.version}): load it with verify=False to trust its files")
        self.root, self.index, self.verify = root, index, verify
        self._open: dict[str, Any] = {}
        self._files: dict[str, Any] = {}
        self._headers: dict[str, tuple[dict, int]] = {}
        self._checked: set[tuple[str, str]] = set()
        self.bytes_read = 0

    def open(self, name: str, key: Optional[str] = None):
        """The open file ``name`` (``key``: the tensor it is opened for, named in errors)."""
        handle = self._open.get(name)
        if handle is not None:
            return handle
        path = self.root / name
        of = f" (it holds tensor {key})" if key is not None else ""
        expected = self.index.files[name]       # Index.from_json: every piece's file is listed
        # Every later read of this file (header, checksums, slices) goes through what is opened
        # here: a writer that removes the generation afterwards cannot take it from under us.
        try:
            fh = open(path, "rb")
        except OSError as exc:
            raise CheckpointError(f"checkpoint file {path} is missing{of}: {exc}") from exc
        self._files[name] = fh
        size = os.fstat(fh.fileno()).st_size
        if size != expected:
            raise CheckpointError(f"checkpoint file {path} is {size} bytes; the index records "
                                  f"{expected} (truncated or overwritten){of}")
        header, data_start = _read_header(fh, path, size, of)
        saved_by = (header.get("__metadata__") or {}).get(_SAVE_ID_KEY)
        if self.index.save_id is not None and saved_by != self.index.save_id:
            raise CheckpointError(
                f"checkpoint file {path} was written by save {saved_by!r}, the index by "
                f"save {self.index.save_id!r}: the file belongs to another checkpoint (copied "
                f"or left by another writer){of}; restore this save's file or load another "
                "checkpoint")
        _check_extents(path, header)
        try:
            # by its /proc/self/fd path where there is one: the very file opened above
            fd_path = f"/proc/self/fd/{fh.fileno()}"
            handle = safe_open(fd_path if os.path.exists(fd_path) else str(path),
                               framework="numpy")
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"checkpoint file {path} cannot be read{of}: {exc}") from exc
        self._headers[name] = (header, data_start)
        self._open[name] = handle
        return handle

    def close(self) -> None:
        """Close the files this reader opened (the values it returned are copies)."""
        for fh in self._files.values():
            fh.close()
        self._files.clear()
        self._open.clear()

    def check(self, key: str, piece: Piece) -> None:
        """Check ``key``'s piece in its file against the index (once per piece)."""
        if (piece.file, key) in self._checked:
            return
        self.open(piece.file, key)
        header, data_start = self._headers[piece.file]
        path = self.root / piece.file
        record = self.index.tensors[key]
        entry = header.get(key)
        if not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint file {path} holds no tensor {key}, which the "
                                  "index places there")
        want = _FILE_DTYPES.get(record.dtype)
        if entry.get("dtype") != want:
            raise CheckpointError(
                f"checkpoint file {path}: tensor {key} is stored as {entry.get('dtype')}, the "
                f"index records {record.dtype} ({want}): the file's header was changed")
        if tuple(entry.get("shape", ())) != piece.box.lengths:
            raise CheckpointError(
                f"checkpoint file {path}: tensor {key} has shape {tuple(entry.get('shape', ()))}, "
                f"the index records {piece.box.lengths}")
        if self.verify:
            begin, end = entry["data_offsets"]
            got = _hash_range(self._files[piece.file], path, data_start + begin,
                              data_start + end)
            if got != piece.checksum:
                raise CheckpointError(
                    f"checkpoint file {path}: tensor {key}: its bytes do not match the checksum "
                    f"the index records ({CHECKSUM} {got}, recorded {piece.checksum}): the file "
                    "is corrupted; restore it or load another checkpoint")
        self._checked.add((piece.file, key))

    def read(self, key: str, piece: Piece, part: Box) -> np.ndarray:
        """``part`` (a box inside ``piece.box``) of ``key``'s piece."""
        self.check(key, piece)
        handle = self.open(piece.file, key)
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


def _check_extents(path: Path, header: dict) -> None:
    """Each tensor's byte range in the header fits its dtype and shape (else safetensors' own
    refusal would name only the file)."""
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        try:
            begin, end = entry["data_offsets"]
            size = int(np.prod(entry["shape"], dtype=np.int64)) * _ITEMSIZES[entry["dtype"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint file {path}: tensor {key} has an unreadable "
                                  f"header entry {entry!r}: the file is corrupted") from exc
        if end - begin != size:
            raise CheckpointError(
                f"checkpoint file {path}: tensor {key} spans bytes [{begin}, {end}) but its "
                f"dtype {entry['dtype']} and shape {tuple(entry['shape'])} take {size}: the "
                "file's header was changed; restore it or load another checkpoint")


def _hash_range(fh, path: Path, begin: int, end: int) -> str:
    """The checksum of bytes ``[begin, end)`` of the open file ``fh``, hashed from the mapped
    file (no copy)."""
    if end <= begin:
        return _hex(xxhash.xxh3_64_intdigest(b""))
    try:
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            with memoryview(mapped) as view:
                part = view[begin:end]
                try:
                    return _hex(xxhash.xxh3_64_intdigest(part))
                finally:
                    part.release()
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read: {exc}") from exc


def verify_checkpoint(root: Path, index: Index, checksums: bool = True) -> None:
    """Check every file and piece of a checkpoint without loading it (sizes, save ids, dtypes,
    shapes, and with ``checksums`` the bytes): what a launcher runs before any rank starts."""
    reader = PieceReader(root, index, verify=checksums)
    try:
        for key, record in index.tensors.items():
            for piece in record.pieces:
                reader.check(key, piece)
        for name in index.files:
            reader.open(name)
    finally:
        reader.close()
