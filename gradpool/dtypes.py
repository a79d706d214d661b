"""The gradient dtypes gradpool manages, their sizes, the one write into a bucket, and a CPU
tensor's memory (host memory) as NumPy (:func:`host_alias`).

MindSpore 2.10's CPU backend rejects slice-assignment into bfloat16 ("type_id:45 is invalid") and
silently drops ``copy_`` into a view at a non-zero offset, so the portable write is
slice-assignment through an int16 view for bfloat16 (bit-exact), and whole-tensor ``copy_`` only
where the destination is its whole storage (there ``copy_`` also casts in the same kernel).
"""
from __future__ import annotations

import ctypes
from typing import Callable, Optional

import ml_dtypes
import mindspore as ms
import numpy as np

from gradpool.errors import UnsupportedDtypeError

DTYPE_NAMES = ("float32", "float16", "bfloat16")
SUPPORTED_DTYPES = tuple(getattr(ms, name) for name in DTYPE_NAMES)
_ITEMSIZE = {ms.float32: 4, ms.float16: 2, ms.bfloat16: 2}
# Hashing a MindSpore dtype is a pybind call: the hot path looks sizes up by the id() of the
# singleton that _known returns (docs/benchmarks/host-path.md#dtype-lookups).
_SIZE_OF = {id(dtype): size for dtype, size in _ITEMSIZE.items()}
# See nan_fill; 0x7FC0 is bfloat16's quiet NaN as an int16 bit pattern.
_NAN_FILL = {ms.float32: float("nan"), ms.float16: float("nan"), ms.bfloat16: 0x7FC0}


def _known(dtype):
    """``dtype`` as the supported dtype object it is (None if none). MindSpore's dtypes are
    singletons and ``==`` is a pybind call (docs/benchmarks/host-path.md#dtype-lookups) the pack
    path would make several times per call, so identity is tried first, ``==`` after."""
    for known in SUPPORTED_DTYPES:
        if dtype is known:
            return known
    for known in SUPPORTED_DTYPES:
        if dtype == known:
            return known
    return None


def check_dtype(dtype) -> None:
    """Raise :class:`UnsupportedDtypeError` unless gradpool manages ``dtype``."""
    if _known(dtype) is None:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise UnsupportedDtypeError(f"dtype {dtype} is not supported; supported dtypes: {names}")


def is_supported_singleton(dtype) -> bool:
    """True when ``dtype`` is one of the supported dtype objects themselves (not merely equal to
    one): its id() then stays unique for the process's life, and can key a cache."""
    return id(dtype) in _SIZE_OF


def itemsize(dtype) -> int:
    size = _SIZE_OF.get(id(dtype))     # the supported singletons themselves
    if size is not None:
        return size
    check_dtype(dtype)
    return _SIZE_OF[id(_known(dtype))]


def dtype_named(name: str):
    """The MindSpore dtype called ``name`` (one of :data:`DTYPE_NAMES`)."""
    if name not in DTYPE_NAMES:
        raise UnsupportedDtypeError(
            f"dtype name {name!r} is not supported; use one of {', '.join(DTYPE_NAMES)}")
    return getattr(ms, name)


def nan_fill(dtype):
    """What :func:`writable_view` of a ``dtype`` tensor is assigned to make it all NaN."""
    return _NAN_FILL[dtype]


def writable_view(tensor: ms.Tensor) -> ms.Tensor:
    """A view of ``tensor`` that slice-assignment can write on every backend (bfloat16 as int16)."""
    return tensor.view(ms.int16) if tensor.dtype == ms.bfloat16 else tensor


def is_whole_storage(tensor: ms.Tensor) -> bool:
    """True when ``tensor`` starts at offset 0 and spans its whole storage."""
    known = _known(tensor.dtype)
    return known is not None and tensor.storage_offset() == 0 \
        and tensor.numel() * _SIZE_OF[id(known)] == tensor.untyped_storage().size()


def overwrite(dst: ms.Tensor, src: ms.Tensor) -> None:
    """Overwrite all of flat ``dst`` with flat ``src`` of the same length, cast to ``dst``'s dtype:
    ``copy_`` when both span their whole storage (on CPU it refuses a view of a larger storage on
    either side), else slice-assignment, which lands in a prefix view on CPU and Ascend alike."""
    if is_whole_storage(dst) and is_whole_storage(src):
        dst.copy_(src)
        return
    if src.dtype != dst.dtype:
        src = src.astype(dst.dtype)
    writable_view(dst)[:] = writable_view(src)


def host_address(tensor: ms.Tensor) -> Optional[int]:
    """Where a contiguous CPU ``tensor``'s memory starts (its data pointer); None for a tensor
    that is not contiguous, not on the CPU, empty or lazily initialized (no memory yet).
    MindSpore's data-pointer read waits only for its forward queues (``WaitForward``: not the
    bprop stage, nor a rethrown error), so where queued ops may still write the tensor drain the
    launch queue first (``gradpool.device.drain_launch_queue``), as the host paths do."""
    # init and _size: what has_init (deprecated) and numel() read, without their Python frames
    if tensor.init is not None or tensor.device != "CPU" or not is_contiguous(tensor) \
            or tensor._size == 0:
        return None
    return data_pointer(tensor)


# MindSpore 2.10's Tensor.data_ptr() and is_contiguous() are Python frames around these TensorPy
# methods, which a small pack calls directly (the public ones where a release lacks them).
try:
    from mindspore._c_expression import TensorPy as _TensorPy
    data_pointer: Callable[[ms.Tensor], int] = _TensorPy._data_ptr
    is_contiguous: Callable[[ms.Tensor], bool] = _TensorPy.is_contiguous
except (ImportError, AttributeError):      # pragma: no cover - another MindSpore release
    data_pointer, is_contiguous = ms.Tensor.data_ptr, ms.Tensor.is_contiguous


def host_alias(tensor: ms.Tensor, keep_alive: bool = True) -> Optional[np.ndarray]:
    """The memory of a contiguous CPU ``tensor`` of a supported dtype as a flat NumPy array of
    its ``numel()`` elements (bfloat16 as ``ml_dtypes.bfloat16``); None for any other tensor.
    It waits for nothing: drain the launch queue first if queued ops may still write the tensor.
    The array keeps ``tensor`` alive, as ``asnumpy()``'s does; with ``keep_alive=False`` it is
    valid only while the tensor's storage is (the host writer's bucket view, whose allocation the
    pool's record holds, or a caller holding the tensor). ``np.frombuffer`` over a ctypes array
    at the data pointer is the cheapest way measured (docs/benchmarks/host-path.md#host-views)."""
    dtype = tensor.dtype
    size = _SIZE_OF.get(id(dtype))
    if size is None:                   # not a supported singleton itself: one equal to it?
        dtype = _known(dtype)
        if dtype is None:
            return None
        size = _SIZE_OF[id(dtype)]
    address = host_address(tensor)
    if address is None:
        return None
    memory = (ctypes.c_char * (tensor.numel() * size)).from_address(address)
    if keep_alive:
        memory.tensor = tensor
    return np.frombuffer(memory, _HOST_DTYPE[id(dtype)])


# The NumPy dtype of each dtype's memory, by id() of the dtype _known returns (like _SIZE_OF).
_HOST_DTYPE = {id(ms.float32): np.dtype(np.float32), id(ms.float16): np.dtype(np.float16),
               id(ms.bfloat16): np.dtype(ml_dtypes.bfloat16)}


# MindSpore's casts into a 16-bit float write one canonical quiet NaN; NumPy and ml_dtypes keep the
# sign, NumPy the payload (checked on MindSpore 2.10 CPU over every 16-bit pattern).
_NAN_ABOVE = {np.dtype(np.float16): 0x7C00, np.dtype(ml_dtypes.bfloat16): 0x7F80}
_SIGN = 0x8000


def canonicalize_nans(array: np.ndarray) -> None:
    """Rewrite, in place, every NaN of a float16 / bfloat16 array as MindSpore's cast writes it:
    float16 ``0x7E00`` with the sign kept, bfloat16 ``0x7FC0`` (positive); no-op for float32.
    Writes only when a NaN is present, so a NaN-free cast stays one write pass."""
    above = _NAN_ABOVE.get(array.dtype)
    if above is None or array.size == 0:
        return
    bits = array.view(np.uint16)
    # As uint16, negative NaNs are the largest patterns; as int16, positive NaNs are.
    if int(bits.max()) <= (_SIGN | above) and int(bits.view(np.int16).max()) <= above:
        return
    nan = (bits & 0x7FFF) > above
    if array.dtype == np.dtype(np.float16):
        bits[nan] = (bits[nan] & _SIGN) | 0x7E00
    else:
        bits[nan] = 0x7FC0
