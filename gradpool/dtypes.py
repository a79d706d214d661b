"""The one list of gradient dtypes gradpool manages, their sizes, and the one write into a bucket.

Every module that needs to know "is this dtype supported", "how many bytes is an element" or
"how do I write these values into that tensor on every backend" asks here.

MindSpore 2.10's CPU backend rejects slice-assignment into bfloat16 ("type_id:45 is invalid") and
silently drops ``copy_`` into a view at a non-zero offset, so the portable write is
slice-assignment through an int16 view for bfloat16 (bit-exact), and whole-tensor ``copy_`` only
where the destination is its whole storage (there ``copy_`` also casts in the same kernel).

On the CPU backend a contiguous tensor's memory is host memory: :func:`host_alias` is it as a
NumPy array (the CPU communicators copy through it; the host writer, :mod:`gradpool.host`,
writes buckets through it).
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
# Written through :func:`writable_view`, this makes every element NaN (0x7FC0 is bfloat16's quiet
# NaN as an int16 bit pattern).
_NAN_FILL = {ms.float32: float("nan"), ms.float16: float("nan"), ms.bfloat16: 0x7FC0}


def _known(dtype):
    """``dtype`` as the supported dtype object it is (None if it is none of them).

    MindSpore's dtypes are singletons and ``==`` between two of them is a pybind call
    (docs/benchmarks/host-path.md#dtype-lookups), so identity is tried first; ``==`` stays the
    rule for anything equal but not identical. The pack path asks this several times per call."""
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


def host_address(tensor: ms.Tensor) -> Optional[int]:
    """Where a contiguous CPU ``tensor``'s memory starts (its data pointer); None for a tensor
    that is not contiguous, not on the CPU, empty or lazily initialized (no memory yet).

    MindSpore's device and data-pointer reads wait for its forward queues (``WaitForward``: not
    the bprop stage, nor any rethrown error a full wait reports), so drain the launch queue
    first (``gradpool.device.drain_launch_queue``), as the host paths do, where queued ops may
    still write the tensor."""
    # init is read directly, as the deprecated has_init property does; _size is what numel()
    # returns, without its Python frame
    if tensor.init is not None or tensor.device != "CPU" or not is_contiguous(tensor) \
            or tensor._size == 0:
        return None
    return data_pointer(tensor)


# MindSpore 2.10's Tensor.data_ptr() and is_contiguous() are Python frames around these TensorPy
# methods; a small pack calls three of them, so it calls the methods themselves (the public
# ones where a release has no such name).
try:
    from mindspore._c_expression import TensorPy as _TensorPy
    data_pointer: Callable[[ms.Tensor], int] = _TensorPy._data_ptr
    is_contiguous: Callable[[ms.Tensor], bool] = _TensorPy.is_contiguous
except (ImportError, AttributeError):      # pragma: no cover - another MindSpore release
    data_pointer, is_contiguous = ms.Tensor.data_ptr, ms.Tensor.is_contiguous


def host_alias(tensor: ms.Tensor, keep_alive: bool = True) -> Optional[np.ndarray]:
    """The memory of a contiguous CPU ``tensor`` of a supported dtype as a flat NumPy array of
    its ``numel()`` elements (bfloat16 as ``ml_dtypes.bfloat16``), from its data pointer; None
    for any other tensor.

    It waits for nothing: drain the launch queue first (``gradpool.device.synchronize``) if
    queued ops may still write the tensor. The array keeps ``tensor`` alive, as ``asnumpy()``'s
    does; with ``keep_alive=False`` it does not, and is valid only while the tensor's storage is
    (the host writer's view of a bucket, whose allocation the pool's record holds, or a caller
    that holds the tensor).

    Built with ``np.frombuffer`` over a ctypes array at the data pointer, the cheapest of the
    ways measured (an ``__array_interface__`` object and ``asnumpy()`` cost more, and a small
    pack's fixed cost is a few of these: docs/benchmarks/host-path.md#host-views)."""
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


# The NumPy dtype of each dtype's memory (bfloat16 as ml_dtypes'); by id() of the dtype that
# _known returns, like _SIZE_OF.
_HOST_DTYPE = {id(ms.float32): np.dtype(np.float32), id(ms.float16): np.dtype(np.float16),
               id(ms.bfloat16): np.dtype(ml_dtypes.bfloat16)}
