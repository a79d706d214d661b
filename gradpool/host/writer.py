"""The host writer: a CPU pool's buckets written in place through their own host memory.

On CPU a tensor's memory is host memory, and MindSpore's CPU copy kernel runs well below memcpy
bandwidth, its casts slower still (docs/benchmarks/host-path.md#cpu-copy-kernel-bandwidth). So
:class:`HostWriter` writes with NumPy / ml-dtypes (:mod:`gradpool.host.views`), for every dtype
pair and shard dim, casting while writing and accumulating in float32 rounded once; cast NaNs are
made MindSpore's canonical NaN, so both writers write the same bits (``tests/test_pack_casts.py``).
A single gradient whose bucket is the flat gradient takes a compiled write between the two
addresses (:mod:`gradpool.host.kernels`) where its dtype pair has one.
"""
from __future__ import annotations

import ctypes
import functools
import math
import weakref
from typing import Optional, Sequence

import ml_dtypes
import mindspore as ms
import numpy as np

from gradpool.device import drain_launch_queue
from gradpool.dtypes import (canonicalize_nans, data_pointer, host_address, host_alias,
                             is_whole_storage, itemsize)
from gradpool.errors import LeaseStateError
from gradpool.host import kernels
from gradpool.host.views import compiled_array_write, compiled_cast, compiled_writer, host_view
from gradpool.layout import GradSlot, ReduceScatterLayout
from gradpool.pack import Written, check_gathered, check_write, unshard
from gradpool.pool import Lease


@functools.lru_cache(maxsize=1)
def host_writer() -> "HostWriter":
    """The process's host writer, made on first use (by a reducer on a CPU pool)."""
    return HostWriter()


class HostWriter:
    """The :class:`gradpool.writers.BucketWriter` of CPU pools; every write is done when the call
    returns (``Written.on_host``). Nothing is waited for but the launch queue, drained once per
    call so NumPy comes after every queued op that writes a gradient or the bucket."""

    def __init__(self):
        kernels.compile_host_loops()      # here, so no pack compiles inside a training step
        # id(allocation) -> (data pointer, memory as an array, weak reference). The pool's record
        # owns the allocation; the weak reference's callback drops the entry with it (so the id
        # stays unique), the array keeps nothing alive. A released storage's pointer is 0.
        self._views: dict = {}

    def pack(self, lease: Lease, grads: Sequence[ms.Tensor],
             layout: ReduceScatterLayout) -> Written:
        """Write ``grads`` into ``lease`` per ``layout``: cast to the lease dtype, pad with zeros.
        One gradient whose bucket is the flat gradient first gets a compiled write between the two
        addresses, in one flat block making only the checks that make it safe: after a large copy
        the Python around it runs cold (docs/benchmarks/host-path.md#single-gradient-pack). What
        it declines goes to the general path, which writes it or raises the precise error."""
        # identity_shape: None unless the bucket is the flat gradient
        if len(grads) == 1 and (shape := layout.identity_shape) is not None \
                and lease.numel == layout.total_numel:
            grad = grads[0]
            try:
                # the shape and dtype properties' values, without their (cold) Python frames
                grad_shape, grad_dtype = grad._shape, grad._dtype
            except AttributeError:    # not a MindSpore tensor: the general path names it
                grad_shape = grad_dtype = None
            writer = compiled_writer(grad_dtype, lease.dtype) if grad_shape == shape else None
            if writer is not None:
                drain_launch_queue()          # the producer of grad has run
                # The pool made the allocation whole, on the CPU: its pointer is the bucket's.
                dst = data_pointer(lease.allocation)   # raises LeaseStateError when released
                src = host_address(grad)      # None for a tensor with no memory yet
                if src is not None and dst:
                    numel = lease.numel
                    nbytes, src_nbytes = numel * writer.dst_itemsize, numel * writer.src_itemsize
                    if src < dst + nbytes and dst < src + src_nbytes:
                        # over its own bucket: a cast would overwrite what it has yet to read
                        staged = np.frombuffer(ctypes.string_at(src, src_nbytes), np.uint8)
                        writer.write(dst, staged.ctypes.data, numel)
                    else:
                        writer.write(dst, src, numel)
                    return Written(nbytes, 0, True)
        return self._put(lease, grads, layout, add=False)

    def accumulate(self, lease: Lease, grads: Sequence[ms.Tensor],
                   layout: ReduceScatterLayout) -> Written:
        """Add ``grads`` (packed per ``layout``) into ``lease`` in float32, rounded once."""
        return self._put(lease, grads, layout, add=True)

    def unpack_gathered(self, lease: Lease, layout: ReduceScatterLayout) -> list[ms.Tensor]:
        """:func:`gradpool.pack.unpack_gathered` with NumPy; the bucket is reusable on return."""
        check_gathered(lease, layout)
        drain_launch_queue()          # the collective that filled the bucket has run
        rows = self.bucket_array(lease).reshape(layout.world_size, layout.row_numel)
        # copy() always copies the [W, chunk] column block (ascontiguousarray would return the
        # bucket itself when the block is the whole bucket); from_numpy adopts that copy.
        flats = [ms.from_numpy(rows[:, s.offset:s.offset + s.chunk_numel].copy().reshape(-1))
                 for s in layout.slots]
        return [unshard(flat, slot) for flat, slot in zip(flats, layout.slots)]

    def bucket_array(self, lease: Lease) -> np.ndarray:
        """``[0, numel)`` of the lease's allocation as a NumPy array (bfloat16 as ml_dtypes'), valid
        while the lease is live; writes land in the bucket, nothing is waited for. Built once per
        allocation, but the pointer is read every call: MindSpore may move a tensor's memory (a
        fused all-gather's receive bucket moved during a forward with prefetch)."""
        allocation = lease.allocation           # raises LeaseStateError on a released lease
        pointer = data_pointer(allocation)
        view = self._views.get(id(allocation))
        if view is None or view[0] != pointer:
            view = self._view(lease, allocation, pointer)
        array = view[1]
        return array if lease.numel == array.size else array[:lease.numel]

    # -- internals ------------------------------------------------------------------------------
    def _view(self, lease: Lease, allocation: ms.Tensor, pointer: int) -> tuple:
        array = host_alias(allocation, keep_alive=False) if is_whole_storage(allocation) else None
        if array is None:
            raise LeaseStateError(f"{lease!r} has no host memory; use host=False")
        key = id(allocation)
        ref = weakref.ref(allocation, lambda _, views=self._views: views.pop(key, None))
        view = self._views[key] = (pointer, array, ref)
        return view

    def _put(self, lease: Lease, grads, layout: ReduceScatterLayout, add: bool) -> Written:
        if len(grads) == 1 and layout.is_identity() and isinstance(grads[0], ms.Tensor):
            written = self._put_one(lease, grads[0], layout, add)
            if written is not None:
                return written
        check_write(lease, grads, layout)
        self._write(lease, grads, layout, add)
        size = itemsize(lease.dtype)
        return Written(layout.total_numel * size, 0 if add else layout.padding_numel * size, True)

    def _put_one(self, lease: Lease, grad: ms.Tensor, layout: ReduceScatterLayout,
                 add: bool) -> Optional[Written]:
        """One gradient into a bucket that is the flat gradient, with NumPy (an accumulate, or a
        pack without a compiled writer): the general path's checks and write in one function.
        None, having written nothing, unless ``grad`` is a contiguous CPU tensor of the layout's
        shape and a supported dtype and the lease holds the layout's elements."""
        if grad.shape != layout.slots[0].shape or lease.numel != layout.total_numel:
            return None
        drain_launch_queue()          # as in _write: the producer of grad has run
        bucket = self.bucket_array(lease)   # raises LeaseStateError on a released lease
        src = host_alias(grad, keep_alive=False)     # the caller holds grad while this runs
        if src is None:
            return None
        if not add and src.dtype == bucket.dtype:
            if not compiled_array_write(bucket, src):
                np.copyto(bucket, src)
            return Written(layout.total_numel * bucket.dtype.itemsize, 0, True)
        if np.may_share_memory(bucket, src):
            # NumPy buffers an overlapping 1-D copy only for negative strides; a cast over its
            # own source would overwrite elements it has yet to read.
            src = src.copy()
        if _write_flat(bucket, src, add) and bucket.dtype.itemsize == 2:
            canonicalize_nans(bucket)
        return Written(layout.total_numel * bucket.dtype.itemsize, 0, True)

    def _write(self, lease: Lease, grads, layout: ReduceScatterLayout, add: bool) -> None:
        """The general path: write (or add) into the bucket's own host memory with NumPy."""
        # One drain orders the NumPy writes after every queued op writing the bucket (a pending
        # poison fill) or a gradient; the views below wait for nothing.
        drain_launch_queue()
        bucket = self.bucket_array(lease)
        if layout.is_identity():
            # one call, none of the per-chunk bookkeeping (most of a small pack's fixed cost)
            rounded = _write_flat(bucket, _source_array(grads[0]), add)
        else:
            rounded = add
            rows = bucket.reshape(layout.world_size, layout.row_numel)
            if not add:
                for start, end in layout.gaps():
                    rows[:, start:end] = 0
            # NaN and out-of-range values cast as in MindSpore (NaN, inf): NumPy's warning is noise
            with np.errstate(invalid="ignore", over="ignore"):
                for slot, grad in zip(layout.slots, grads):
                    rounded = _write_chunks(rows, _source_array(grad), slot, add) or rounded
        if rounded and bucket.dtype.itemsize == 2:
            canonicalize_nans(bucket)


def _write_flat(bucket: np.ndarray, src: np.ndarray, add: bool) -> bool:
    """Write (or add) flat ``src`` into flat ``bucket`` of the same length; True when the result
    was rounded into a narrower dtype by NumPy (its NaNs still to canonicalize)."""
    if not add and compiled_array_write(bucket, src):
        return False          # a cast's NaNs written canonical already
    rounded = add or src.dtype != bucket.dtype
    if not rounded:
        np.copyto(bucket, src)
    elif not add and compiled_cast(bucket, src):
        rounded = False       # NaNs written canonical already
    elif not add and (src.dtype, bucket.dtype) in _QUIET_CASTS:
        np.copyto(bucket, src, casting="unsafe")
    else:
        with np.errstate(invalid="ignore", over="ignore"):
            _into(bucket, src, add)
    return rounded


# Casts that raise no floating-point flag for any input (ml_dtypes widens bfloat16 with integer
# ops; tests/test_pack_casts.py checks) skip np.errstate, a noticeable part of a small pack
# (docs/benchmarks/host-path.md#floating-point-error-state); narrowing casts do flag.
_QUIET_CASTS = frozenset({(np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32))})


def _source_array(grad: ms.Tensor) -> np.ndarray:
    """A gradient's values to read (flat): its memory when it is a contiguous CPU tensor (even a
    view ``asnumpy()`` would copy), else ``host_view``'s copy; the caller holds ``grad``."""
    array = host_alias(grad, keep_alive=False)
    return array if array is not None else host_view(grad).reshape(-1)


def _write_chunks(rows: np.ndarray, src: np.ndarray, slot: GradSlot, add: bool) -> bool:
    """Write ``src`` (of ``slot.shape``) as its W chunks along the shard dim into ``rows``
    (``[W, row_numel]``) at ``slot.offset``; a chunk's padding past the gradient is zeroed (pack)
    or left alone (accumulate: it holds the zeros the pack wrote). True when NumPy rounded
    into the bucket's dtype (its NaNs still to canonicalize)."""
    world, chunk, dim = slot.world_size, slot.chunk_size, slot.shard_dim
    length = slot.shape[dim]
    outer = math.prod(slot.shape[:dim])
    inner = slot.numel // (outer * length)
    src = src.reshape(outer, length, inner)
    # Splitting the contiguous column range of every row: a view, the writes land in the bucket.
    dst = rows[:, slot.offset:slot.offset + outer * chunk * inner].reshape(world, outer, chunk,
                                                                           inner)
    rounded = add or src.dtype != rows.dtype
    if length == world * chunk:
        if outer == 1 and chunk * inner * rows.dtype.itemsize >= _RUN_FROM_BYTES:
            # dim 0 sharded: each rank's chunk is one contiguous run on both sides
            runs, end = src.reshape(world, chunk * inner), slot.offset + chunk * inner
            return any([_write_run(rows[rank, slot.offset:end], runs[rank], add)
                        for rank in range(world)])
        # one strided write for all ranks
        _into(dst, src.reshape(outer, world, chunk, inner).transpose(1, 0, 2, 3), add)
        return rounded
    narrowed = add
    for rank in range(world):
        start = rank * chunk
        valid = max(0, min(chunk, length - start))
        if valid:
            narrowed = _write_run(dst[rank, :, :valid], src[:, start:start + valid], add) \
                or narrowed
        if valid < chunk and not add:
            dst[rank, :, valid:] = 0
    return narrowed


# From this many bytes per rank an even dim-0 shard is written one rank's run at a time, each a
# compiled write (streaming stores, the compiled cast); below, the one strided NumPy write of all
# ranks costs less than a Python call per rank.
_RUN_FROM_BYTES = 64 << 10


def _write_run(dst: np.ndarray, src: np.ndarray, add: bool) -> bool:
    """Write (or add) ``src`` into ``dst`` of the same shape: a compiled write where both are
    contiguous (:func:`compiled_array_write`), else NumPy. True when NumPy rounded into the
    bucket's dtype (its NaNs still to canonicalize)."""
    if not add and compiled_array_write(dst, src):
        return False
    _into(dst, src, add)
    return add or src.dtype != dst.dtype


def _into(dst: np.ndarray, src: np.ndarray, add: bool) -> None:
    if add:
        # float32 arithmetic whatever the dtypes, rounded once into the bucket's dtype.
        np.add(dst, src, out=dst, dtype=np.float32, casting="unsafe")
    else:
        np.copyto(dst, src, casting="unsafe")
