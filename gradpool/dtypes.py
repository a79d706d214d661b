"""The one list of gradient dtypes gradpool manages, their sizes, and the one write into a bucket.

Every module that needs to know "is this dtype supported", "how many bytes is an element" or
"how do I write these values into that tensor on every backend" asks here.

MindSpore 2.10's CPU backend rejects slice-assignment into bfloat16 ("type_id:45 is invalid") and
silently drops ``copy_`` into a view at a non-zero offset, so the portable write is
slice-assignment through an int16 view for bfloat16 (bit-exact), and whole-tensor ``copy_`` only
where the destination is its whole storage (there ``copy_`` also casts in the same kernel).

On the CPU backend ``asnumpy()`` of a whole tensor is the tensor's own memory, bfloat16 included
(MindSpore returns its own NumPy bfloat16 type there, whose casts are slow): :func:`host_view`
reinterprets that memory as ``ml_dtypes.bfloat16``, whose casts are several times faster, so
NumPy can write and cast into a bucket in place for every supported dtype (:data:`HOST_DTYPES`).
"""
from __future__ import annotations

import ml_dtypes
import mindspore as ms
import numpy as np

from gradpool.errors import UnsupportedDtypeError

DTYPE_NAMES = ("float32", "float16", "bfloat16")
SUPPORTED_DTYPES = tuple(getattr(ms, name) for name in DTYPE_NAMES)
_ITEMSIZE = {ms.float32: 4, ms.float16: 2, ms.bfloat16: 2}
# The dtypes NumPy can write in place (bfloat16 through ml_dtypes, see host_view).
HOST_DTYPES = (ms.float32, ms.float16, ms.bfloat16)
# Written through :func:`writable_view`, this makes every element NaN (0x7FC0 is bfloat16's quiet
# NaN as an int16 bit pattern).
_NAN_FILL = {ms.float32: float("nan"), ms.float16: float("nan"), ms.bfloat16: 0x7FC0}


def check_dtype(dtype) -> None:
    """Raise :class:`UnsupportedDtypeError` unless gradpool manages ``dtype``."""
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise UnsupportedDtypeError(f"dtype {dtype} is not supported; supported dtypes: {names}")


def itemsize(dtype) -> int:
    check_dtype(dtype)
    return _ITEMSIZE[dtype]


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
    size = _ITEMSIZE.get(tensor.dtype)
    return size is not None and tensor.storage_offset() == 0 \
        and tensor.numel() * size == tensor.untyped_storage().size()


def overwrite(dst: ms.Tensor, src: ms.Tensor) -> None:
    """Overwrite all of flat ``dst`` with flat ``src`` of the same length, cast to ``dst``'s dtype.

    ``copy_`` when both span their whole storage (one kernel, cast included; on CPU it refuses a
    view of a larger storage on either side), else slice-assignment, the one write that lands in
    a prefix view on CPU and on Ascend alike."""
    if is_whole_storage(dst) and is_whole_storage(src):
        dst.copy_(src)
        return
    if src.dtype != dst.dtype:
        src = src.astype(dst.dtype)
    writable_view(dst)[:] = writable_view(src)


def host_view(tensor: ms.Tensor) -> np.ndarray:
    """``tensor``'s values as a NumPy array of its own dtype (bfloat16 as ``ml_dtypes.bfloat16``).

    On the CPU backend this is the tensor's memory when the tensor spans its whole storage (writes
    land in the tensor); otherwise (a prefix or offset view, a non-contiguous tensor, a device
    tensor) ``asnumpy()`` returns a copy, fine for reading only. ``asnumpy()`` first waits for the
    queued ops that write the tensor, so NumPy reads and writes are ordered after them."""
    array = tensor.asnumpy()
    if tensor.dtype == ms.bfloat16:
        # MindSpore's own NumPy bfloat16 casts ~6x slower than ml_dtypes': same bits, other type.
        return array.view(np.uint16).view(ml_dtypes.bfloat16)
    return array


# MindSpore's casts into a 16-bit float write one canonical quiet NaN; NumPy (float16) and
# ml_dtypes (bfloat16) keep the sign, and NumPy keeps payload bits. Measured on MindSpore 2.10 CPU
# over every bfloat16/float16 bit pattern and random float32 ones.
_NAN_ABOVE = {np.dtype(np.float16): 0x7C00, np.dtype(ml_dtypes.bfloat16): 0x7F80}
_SIGN = 0x8000


def canonicalize_nans(array: np.ndarray) -> None:
    """Rewrite, in place, every NaN of a float16 / bfloat16 array as MindSpore's cast writes it:
    float16 ``0x7E00`` with the sign kept, bfloat16 ``0x7FC0`` (positive). No-op for float32.

    Reads the array once (two integer max-reductions: no temporary) and writes only when a NaN
    is present, so a NaN-free cast stays one write pass."""
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
