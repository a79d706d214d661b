"""A CPU tensor's memory as NumPy sees it, and the casts the host writer makes into it.

On the CPU backend ``asnumpy()`` of a whole tensor is the tensor's own memory, bfloat16 included
(MindSpore returns its own NumPy bfloat16 type there, whose casts are slow): :func:`host_view`
reinterprets that memory as ``ml_dtypes.bfloat16``, whose casts are several times faster, so
NumPy can write and cast into a bucket in place for every supported dtype. A cast into a 16-bit
float writes MindSpore's NaNs (:func:`canonicalize_nans`); float32 -> bfloat16 has a compiled
loop (:func:`compiled_cast`), and the single-gradient pairs compiled writes between two
addresses (:func:`compiled_writer`).
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import ml_dtypes
import mindspore as ms
import numpy as np
from mindspore.graph.api import _pynative_executor

from gradpool.dtypes import DTYPE_NAMES, host_alias, is_whole_storage, itemsize
from gradpool.host import kernels


def host_view(tensor: ms.Tensor) -> np.ndarray:
    """``tensor``'s values as a NumPy array of its own dtype (bfloat16 as ``ml_dtypes.bfloat16``).

    On the CPU backend this is the tensor's memory when the tensor spans its whole storage (writes
    land in the tensor); otherwise (a prefix or offset view, a non-contiguous tensor, a device
    tensor) ``asnumpy()`` returns a copy, fine for reading only. ``asnumpy()`` first waits for the
    queued ops that write the tensor, so NumPy reads and writes are ordered after them."""
    if is_whole_storage(tensor):
        # Not asnumpy(), most of whose cost is NumPy parsing the buffer's format string in
        # Python (a pack makes two; docs/benchmarks/host-path.md#host-views); its wait is kept
        # by draining the launch queue (every op launched so far has run).
        _pynative_executor.sync()
        array = host_alias(tensor)
        if array is not None:
            return array.reshape(tensor.shape)
    array = tensor.asnumpy()
    if tensor.dtype == ms.bfloat16:
        # MindSpore's own NumPy bfloat16 casts far slower than ml_dtypes': same bits, other type
        # (docs/benchmarks/host-path.md#host-views).
        return array.view(np.uint16).view(ml_dtypes.bfloat16)
    return array


class CompiledWriter(NamedTuple):
    """A compiled ``write(dst_address, src_address, numel)`` and its dtypes' element sizes."""

    write: Callable[[int, int, int], None]
    src_itemsize: int
    dst_itemsize: int


def compiled_writer(src_dtype, dst_dtype) -> Optional[CompiledWriter]:
    """The compiled write from ``src_dtype`` into ``dst_dtype`` memory between host addresses
    (:func:`gradpool.host.kernels.address_writer`: bits as MindSpore's cast writes them) with the
    two element sizes; None unless both are supported dtype objects themselves and the pair has
    one. Looked up once per pair (a small pack asks on every call)."""
    key = (id(src_dtype), id(dst_dtype))
    found = _WRITERS.get(key, _UNKNOWN)
    if found is not _UNKNOWN:
        return found
    src, dst = _NAME_OF.get(key[0]), _NAME_OF.get(key[1])
    if src is None or dst is None:
        return None          # not cached: only the singletons' ids are unique for life
    write = kernels.address_writer(src, dst)
    found = None if write is None else CompiledWriter(write, itemsize(src_dtype),
                                                      itemsize(dst_dtype))
    _WRITERS[key] = found
    return found


_WRITERS: dict = {}
_UNKNOWN = object()
_NAME_OF = {id(getattr(ms, name)): name for name in DTYPE_NAMES}


def compiled_cast(dst: np.ndarray, src: np.ndarray) -> bool:
    """Write ``src`` (float32) cast to bfloat16 into ``dst`` of the same length in one compiled
    pass, as MindSpore casts (round to nearest even, inf kept, every NaN written as MindSpore's
    canonical 0x7FC0: no :func:`canonicalize_nans` needed); True if it did. False, having
    written nothing, for any other pair or layout (both must be contiguous), or when numba
    cannot be imported.

    ml_dtypes casts float32 -> bfloat16 one element at a time, far below memcpy speed even in
    cache; the compiled integer loop (:func:`gradpool.host.kernels.bfloat16_kernel`) is
    vectorized and bound by memory traffic, so from ``kernels.STREAM_FROM_BYTES`` written on it
    streams its stores past the cache (docs/benchmarks/host-path.md#compiled-bfloat16-cast). numba
    is a dependency; where it cannot be imported (a platform without its wheels) the ml_dtypes
    cast is used."""
    if src.dtype != _F32 or dst.dtype != _BF16 or src.shape != dst.shape \
            or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        return False
    kernel = kernels.bfloat16_kernel()
    if kernel is None:
        return False
    kernel(src.reshape(-1).view(np.uint32), dst.reshape(-1).view(np.uint16),
           kernels.STREAM_FROM_BYTES)
    return True


_F32, _BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)


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
