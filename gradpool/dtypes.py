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

import ctypes
import logging
from typing import Callable, NamedTuple, Optional

import ml_dtypes
import mindspore as ms
import numpy as np
from mindspore.graph.api import _pynative_executor

from gradpool import kernels
from gradpool.errors import UnsupportedDtypeError

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("float32", "float16", "bfloat16")
SUPPORTED_DTYPES = tuple(getattr(ms, name) for name in DTYPE_NAMES)
_ITEMSIZE = {ms.float32: 4, ms.float16: 2, ms.bfloat16: 2}
# Hashing a MindSpore dtype is a pybind call: the hot path looks sizes up by the id() of the
# singleton that _known returns (docs/benchmarks/host-path.md#dtype-lookups).
_SIZE_OF = {id(dtype): size for dtype, size in _ITEMSIZE.items()}
# The dtypes NumPy can write in place (bfloat16 through ml_dtypes, see host_view).
HOST_DTYPES = (ms.float32, ms.float16, ms.bfloat16)
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


def host_view(tensor: ms.Tensor) -> np.ndarray:
    """``tensor``'s values as a NumPy array of its own dtype (bfloat16 as ``ml_dtypes.bfloat16``).

    On the CPU backend this is the tensor's memory when the tensor spans its whole storage (writes
    land in the tensor); otherwise (a prefix or offset view, a non-contiguous tensor, a device
    tensor) ``asnumpy()`` returns a copy, fine for reading only. ``asnumpy()`` first waits for the
    queued ops that write the tensor, so NumPy reads and writes are ordered after them."""
    dtype = _known(tensor.dtype)
    if dtype is not None and is_whole_storage(tensor):
        # Not asnumpy(), most of whose cost is NumPy parsing the buffer's format string in
        # Python (a pack makes two; docs/benchmarks/host-path.md#host-views); its wait is kept
        # by draining the launch queue (every op launched so far has run).
        _pynative_executor.sync()
        array = host_alias(tensor)
        if array is not None:
            return array.reshape(tensor.shape)
    array = tensor.asnumpy()
    if dtype is ms.bfloat16:
        # MindSpore's own NumPy bfloat16 casts far slower than ml_dtypes': same bits, other type
        # (docs/benchmarks/host-path.md#host-views).
        return array.view(np.uint16).view(ml_dtypes.bfloat16)
    return array


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


def host_writer(src_dtype, dst_dtype) -> Optional[HostWriter]:
    """The compiled write from ``src_dtype`` into ``dst_dtype`` memory between host addresses
    (:func:`gradpool.kernels.address_writer`: bits as MindSpore's cast writes them) with the two
    element sizes; None unless both are supported dtype objects themselves and the pair has one.
    Looked up once per pair (a small pack asks on every call)."""
    key = (id(src_dtype), id(dst_dtype))
    found = _WRITERS.get(key, _UNKNOWN)
    if found is not _UNKNOWN:
        return found
    src, dst = _NAME_OF.get(key[0]), _NAME_OF.get(key[1])
    if src is None or dst is None:
        return None          # not cached: only the singletons' ids are unique for life
    write = kernels.address_writer(src, dst)
    found = None if write is None else HostWriter(write, _SIZE_OF[key[0]], _SIZE_OF[key[1]])
    _WRITERS[key] = found
    return found


class HostWriter(NamedTuple):
    """A compiled ``write(dst_address, src_address, numel)`` and its dtypes' element sizes."""

    write: Callable[[int, int, int], None]
    src_itemsize: int
    dst_itemsize: int


_WRITERS: dict = {}
_UNKNOWN = object()
_NAME_OF = {id(getattr(ms, name)): name for name in DTYPE_NAMES}


def host_alias(tensor: ms.Tensor, keep_alive: bool = True) -> Optional[np.ndarray]:
    """The memory of a contiguous CPU ``tensor`` of a supported dtype as a flat NumPy array of
    its ``numel()`` elements (bfloat16 as ``ml_dtypes.bfloat16``), from its data pointer; None
    for any other tensor.

    It waits for nothing: drain the launch queue first (``gradpool.device.synchronize``) if
    queued ops may still write the tensor. The array keeps ``tensor`` alive, as ``asnumpy()``'s
    does; with ``keep_alive=False`` it does not, and is valid only while the tensor's storage is
    (for the pool's bucket record, which holds the tensor itself, or a caller that holds it).

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


def compiled_cast(dst: np.ndarray, src: np.ndarray) -> bool:
    """Write ``src`` (float32) cast to bfloat16 into ``dst`` of the same length in one compiled
    pass, as MindSpore casts (round to nearest even, inf kept, every NaN written as MindSpore's
    canonical 0x7FC0: no :func:`canonicalize_nans` needed); True if it did. False, having
    written nothing, for any other pair or layout (both must be contiguous), or when numba
    cannot be imported.

    ml_dtypes casts float32 -> bfloat16 one element at a time, far below memcpy speed even in
    cache; the compiled integer loop (:func:`gradpool.kernels.bfloat16_kernel`) is vectorized and
    bound by memory traffic, so from ``kernels.STREAM_FROM_BYTES`` written on it streams its
    stores past the cache (docs/benchmarks/host-path.md#compiled-bfloat16-cast). numba is a
    dependency; where it cannot be imported (a platform without its wheels) the ml_dtypes cast is
    used."""
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
