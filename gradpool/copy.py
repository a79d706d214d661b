"""The few tensor writes into pool buckets, written to behave the same on CPU and on Ascend.

MindSpore 2.10's CPU backend silently ignores ``copy_`` into a view at a non-zero offset, makes
``add_`` out-of-place, rejects slice-assignment into bfloat16 and has no pad kernel. So:

* the bucket content is assembled out-of-place with one ``mint.cat`` (gradients, uneven-shard
  zero rows and alignment gaps in row order) and written with a single whole-tensor write;
  ``mint.cat`` costs ~0.2 us per input, where a slice-assignment per gradient costs ~45 us;
* a single gradient whose layout is the identity is written straight from the gradient, with
  no intermediate (one pass: this is the large-gradient bandwidth path);
* the write is ``copy_`` when the lease is the whole allocation (it casts in the same kernel),
  otherwise slice-assignment through :func:`gradpool.pool.writable_view`;
* accumulation is an out-of-place add written back the same way.

On the CPU backend a tensor's ``asnumpy()`` is the tensor's own host memory, and MindSpore's CPU
copy kernel runs at about half of memcpy bandwidth (4.3 against 9.4 GB/s measured on 64 MiB).
So on CPU, when every dtype is one NumPy has (float32, float16), the same writes are done with
NumPy in place in the lease's allocation: one pass, no intermediate, ~1 us per
gradient. ``HOST_COPIES = False`` forces the device path everywhere; the tests run both paths.

Every caller tensor is only ever read here.
"""
from __future__ import annotations

import functools
import time
from typing import Sequence

import mindspore as ms
from mindspore import mint

from gradpool.device import synchronize
from gradpool.errors import LayoutMismatchError
from gradpool.layout import GradSlot, ReduceScatterLayout
from gradpool.pool import Lease, check_dtype, itemsize, writable_view


HOST_COPIES = True
_HOST_DTYPES = (ms.float32, ms.float16)      # the dtypes NumPy can write in place


def pack(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> None:
    """Write ``grads`` into ``lease`` per ``layout``: cast to the lease dtype, pad with zeros."""
    _put(lease, grads, layout, add=False)


def accumulate(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> None:
    """Add ``grads`` (packed per ``layout``) to what ``lease`` already holds (a micro-step)."""
    _put(lease, grads, layout, add=True)


def _put(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout, add: bool) -> None:
    _check(lease, grads, layout)
    timed = lease.pool.timed_copies
    if timed:
        synchronize()       # so the clock measures this copy, not backward work still queued
    start = time.perf_counter()
    on_host = _host_path(lease, grads, layout)
    if on_host:
        # asnumpy() waits for every queued op that writes the tensor (a pending poison fill, the
        # op that produced a gradient), so the NumPy write below is ordered after them.
        _host_write(lease, grads, layout, add=add)
    else:
        packed = _assemble(grads, layout)
        if add:
            packed = _add_once_rounded(lease.tensor, packed)
        _write(lease, packed)
    if timed and not on_host:
        synchronize()       # device writes are queued; NumPy writes are done when they return
    _account(lease, layout, start, padding=not add)


def _add_once_rounded(bucket: ms.Tensor, packed: ms.Tensor) -> ms.Tensor:
    """``bucket + packed`` computed in the wider dtype and rounded once (as the NumPy path does)."""
    if packed.dtype == bucket.dtype:
        return mint.add(bucket, packed)
    return mint.add(bucket.astype(ms.float32), packed.astype(ms.float32))


def shard_views(output: ms.Tensor, layout: ReduceScatterLayout) -> list[ms.Tensor]:
    """Each gradient's shard as a view of ``output`` (one rank's row, ``row_numel`` elements).

    A shard has the gradient's ``chunk_shape``; for an uneven shard dim its trailing entries
    (``slot.valid_length(rank)`` onwards) are padding."""
    if output.shape != (layout.row_numel,):
        raise LayoutMismatchError(
            f"output has shape {output.shape}; the layout's row needs ({layout.row_numel},)")
    segments = layout.row_segments()
    parts = mint.split(output, [length for length, _ in segments]) if len(segments) > 1 \
        else (output,)
    return [part.view(slot.chunk_shape) for part, (_, slot) in zip(parts, segments)
            if slot is not None]


# -- internals ---------------------------------------------------------------------------------
def _check(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> None:
    lease.pool._check_own(lease)
    if len(grads) != len(layout.slots):
        raise LayoutMismatchError(
            f"got {len(grads)} gradients for a layout of {len(layout.slots)}; pass one per slot")
    for slot, grad in zip(layout.slots, grads):
        if tuple(grad.shape) != slot.shape:
            raise LayoutMismatchError(
                f"gradient {slot.index} has shape {tuple(grad.shape)}; the layout expects "
                f"{slot.shape}")
        check_dtype(grad.dtype)
    if lease.numel != layout.total_numel:
        raise LayoutMismatchError(
            f"lease holds {lease.numel} elements; the layout needs {layout.total_numel}")


def _account(lease: Lease, layout: ReduceScatterLayout, start: float, padding: bool) -> None:
    """Bytes written into the bucket (padding included); padding is counted when it is written."""
    size = itemsize(lease.dtype)
    lease.pool.record_copy(lease, nbytes=layout.total_numel * size,
                           seconds=time.perf_counter() - start,
                           padding_bytes=layout.padding_numel * size if padding else 0)


def flat_view(tensor: ms.Tensor) -> ms.Tensor:
    """``tensor`` as 1-D (itself when already 1-D: a view op costs a dispatch on CPU)."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.view(tensor.numel()) if tensor.ndim != 1 else tensor


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype) -> ms.Tensor:
    # Read-only filler for padding; cached because allocating it costs as much as a small op.
    return mint.zeros(shape, dtype=dtype)


def _rows(grad: ms.Tensor, slot: GradSlot) -> ms.Tensor:
    """The gradient as ``[W, chunk_numel]``: row r is its r-th chunk along the shard dim."""
    world = slot.world_size
    pad = slot.chunk_size * world - slot.shape[slot.shard_dim]
    if slot.shard_dim == 0:
        flat = flat_view(grad)
        if pad:
            flat = mint.cat([flat, _zeros((pad * slot.chunk_numel // slot.chunk_size,), grad.dtype)])
        return flat.view(world, slot.chunk_numel)
    grad = grad if grad.is_contiguous() else grad.contiguous()
    if pad:
        pad_shape = slot.shape[:slot.shard_dim] + (pad,) + slot.shape[slot.shard_dim + 1:]
        grad = mint.cat([grad, _zeros(pad_shape, grad.dtype)], dim=slot.shard_dim)
    outer = 1
    for d in slot.shape[:slot.shard_dim]:
        outer *= d
    inner = slot.chunk_numel // (outer * slot.chunk_size)
    split = grad.view(outer, world, slot.chunk_size * inner)
    return split.permute(1, 0, 2).contiguous().view(world, slot.chunk_numel)


def _assemble(grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> ms.Tensor:
    """The bucket's content as one flat tensor (the gradient itself for an identity layout)."""
    if layout.is_identity():
        return flat_view(grads[0])
    dtypes = {g.dtype for g in grads}
    dtype = dtypes.pop() if len(dtypes) == 1 else ms.float32   # mixed: cat needs one dtype
    grads = [g if g.dtype == dtype else g.astype(dtype) for g in grads]
    pieces = [_zeros((layout.world_size, length), dtype) if slot is None
              else _rows(grads[slot.index], slot) for length, slot in layout.row_segments()]
    out = mint.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    return out.view(layout.total_numel)


def _write(lease: Lease, src: ms.Tensor) -> None:
    """Overwrite all of ``lease.tensor`` with flat ``src`` (any supported dtype)."""
    dst = lease.tensor
    if lease.is_whole_bucket:
        dst.copy_(src)
        return
    if src.dtype != dst.dtype:
        src = src.astype(dst.dtype)
    writable_view(dst)[:] = writable_view(src)


def _host_path(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> bool:
    return HOST_COPIES and lease.dtype in _HOST_DTYPES \
        and all(g.dtype in _HOST_DTYPES for g in grads) \
        and all(slot.shard_dim == 0 for slot in layout.slots) and lease.pool.device == "CPU"


def _host_write(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout,
                add: bool) -> None:
    """The CPU path: write (or add) into the bucket's own host memory with NumPy."""
    # The whole allocation's asnumpy() is its memory; a prefix view's asnumpy() is a copy.
    rows = lease.allocation.asnumpy()[:lease.numel].reshape(layout.world_size, layout.row_numel)
    if not add:
        for start, end in layout.gaps():
            rows[:, start:end] = 0
    for slot, grad in zip(layout.slots, grads):
        region = rows[:, slot.offset:slot.offset + slot.chunk_numel]
        src = grad.asnumpy().reshape(-1)
        width = slot.chunk_numel
        full, rest = divmod(slot.numel, width)
        if add:
            region[:full] += src[:full * width].reshape(full, width)
            if rest:
                region[full, :rest] += src[full * width:]
            continue
        region[:full] = src[:full * width].reshape(full, width)
        if rest:
            region[full, :rest] = src[full * width:]
            region[full, rest:] = 0
        region[full + (1 if rest else 0):] = 0
