"""A CPU tensor's memory as NumPy sees it, and the casts the host writer makes into it.

:func:`host_view` gives a CPU tensor's memory with bfloat16 as ``ml_dtypes.bfloat16``, same bits
as MindSpore's own NumPy bfloat16 but far faster casts (docs/benchmarks/host-path.md#host-views),
so NumPy can write and cast into a bucket in place for every supported dtype. float32 -> bfloat16
has a compiled loop (:func:`compiled_cast`), the single-gradient pairs compiled writes between
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
    """``tensor``'s values as a NumPy array of its own dtype (bfloat16 as ``ml_dtypes.bfloat16``):
    on the CPU backend the tensor's memory when it spans its whole storage (writes land in it),
    else a copy for reading only. Ordered after the queued ops that write the tensor."""
    if is_whole_storage(tensor):
        # Not asnumpy(), whose cost is mostly NumPy parsing the buffer's format string
        # (docs/benchmarks/host-path.md#host-views); its wait is kept by draining the queue.
        _pynative_executor.sync()
        array = host_alias(tensor)
        if array is not None:
            return array.reshape(tensor.shape)
    array = tensor.asnumpy()
    if tensor.dtype == ms.bfloat16:
        return array.view(np.uint16).view(ml_dtypes.bfloat16)
    return array


class CompiledWriter(NamedTuple):
    """A compiled ``write(dst_address, src_address, numel)`` and its dtypes' element sizes."""

    write: Callable[[int, int, int], None]
    src_itemsize: int
    dst_itemsize: int


def compiled_writer(src_dtype, dst_dtype) -> Optional[CompiledWriter]:
    """:func:`gradpool.host.kernels.address_writer` for two supported dtype singletons, with
    their element sizes, or None; looked up once per pair (a small pack asks every call)."""
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


def compiled_array_write(dst: np.ndarray, src: np.ndarray) -> bool:
    """Write ``src`` into ``dst`` (same shape, both contiguous, memory apart) with the compiled
    address writer of their dtypes: a copy, or a cast written as MindSpore casts (float32 ->
    bfloat16 NaNs as 0x7FC0 already); True if it did. False, having written nothing, for another
    pair, a strided or overlapping pair, or without numba: the caller writes it with NumPy.
    What lets a padded or fused bucket's contiguous runs (a dim-0 shard's chunk) stream their
    stores and cast at the compiled loop's speed, as the single-gradient pack does."""
    if src.shape != dst.shape or not (src.flags.c_contiguous and dst.flags.c_contiguous):
        return False
    write = kernels.address_writer(src.dtype.name, dst.dtype.name) \
        if src.dtype.name in _ARRAY_NAMES and dst.dtype.name in _ARRAY_NAMES else None
    if write is None or src.size == 0 or np.may_share_memory(dst, src):
        return False
    write(dst.ctypes.data, src.ctypes.data, src.size)
    return True


# NumPy dtype names of the arrays host_view and host_alias give (bfloat16: ml_dtypes').
_ARRAY_NAMES = frozenset(DTYPE_NAMES)


def compiled_cast(dst: np.ndarray, src: np.ndarray) -> bool:
    """Write ``src`` (float32) cast to bfloat16 into ``dst`` of the same length in one compiled
    pass, as MindSpore casts (nearest even, inf kept, NaN as 0x7FC0); True if it did. False,
    having written nothing, for another pair, a non-contiguous array or without numba (the caller
    then uses ml_dtypes, which casts one element at a time, far below memcpy speed, where this
    loop is vectorized: docs/benchmarks/host-path.md#compiled-bfloat16-cast)."""
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
