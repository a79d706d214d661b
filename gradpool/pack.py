"""The writes into pool buckets (pack, accumulate), the shard views of an output bucket, and the
chunk geometry of one parameter (its local shard, and the full tensor back from all chunks).

Every function takes its inputs explicitly (destination lease, gradients, layout) and returns
what it wrote; the caller records statistics. Caller tensors are only ever read here.

MindSpore 2.10's CPU backend silently ignores ``copy_`` into a view at a non-zero offset, makes
``add_`` out-of-place, rejects slice-assignment into bfloat16 and has no pad kernel. So on the
**device path** (portable to Ascend):

* the bucket content is assembled out-of-place with one ``mint.cat`` (gradients, uneven-shard
  zero rows and alignment gaps in row order) and written once with
  :func:`gradpool.dtypes.overwrite`; ``mint.cat`` costs ~0.2 us per input, where a
  slice-assignment per gradient costs ~45 us;
* a single gradient whose layout is the identity is written straight from the gradient (one
  pass: the large-gradient bandwidth path);
* accumulation is an out-of-place add written back the same way.

On the CPU backend a tensor's ``asnumpy()`` is its own host memory, and MindSpore's CPU copy
kernel runs at about half of memcpy bandwidth. So with ``host=True`` on a CPU pool, when every
dtype is one NumPy has (float32, float16), the **host path** writes with NumPy in place in the
lease's allocation: one pass, no intermediate, ~1 us per gradient.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import mindspore as ms
from mindspore import mint

from gradpool.dtypes import HOST_DTYPES, check_dtype, itemsize, overwrite
from gradpool.errors import LayoutMismatchError
from gradpool.layout import GradSlot, ReduceScatterLayout
from gradpool.pool import Lease


@dataclass(frozen=True)
class Written:
    """What one pack or accumulate wrote into its bucket."""

    nbytes: int           # bytes written (padding included)
    padding_bytes: int    # of those, zero padding (none for an accumulate, which adds)
    on_host: bool         # written by NumPy (done on return), else device ops were queued


def pack(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout, *,
         host: bool) -> Written:
    """Write ``grads`` into ``lease`` per ``layout``: cast to the lease dtype, pad with zeros.

    ``host``: take the NumPy host path where it applies (CPU pool, NumPy dtypes, dim-0 shards)."""
    return _put(lease, grads, layout, add=False, host=host)


def accumulate(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout, *,
               host: bool) -> Written:
    """Add ``grads`` (packed per ``layout``) to what ``lease`` holds (a micro-step); the sum is
    computed in the wider dtype and rounded once into the bucket."""
    return _put(lease, grads, layout, add=True, host=host)


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


def flat_view(tensor: ms.Tensor) -> ms.Tensor:
    """``tensor`` as 1-D (itself when already 1-D: a view op costs a dispatch on CPU)."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.view(tensor.numel()) if tensor.ndim != 1 else tensor


# -- one parameter's chunks ----------------------------------------------------------------------
def chunk_rows(tensor: ms.Tensor, slot: GradSlot) -> ms.Tensor:
    """``tensor`` (of ``slot.shape``) as ``[W, chunk_numel]``: row r is its r-th chunk along the
    shard dim, the shard dim zero-padded up to ``W * chunk_size``."""
    world = slot.world_size
    pad = slot.chunk_size * world - slot.shape[slot.shard_dim]
    if slot.shard_dim == 0:
        flat = flat_view(tensor)
        if pad:
            flat = mint.cat([flat, _zeros((pad * slot.chunk_numel // slot.chunk_size,),
                                          tensor.dtype)])
        return flat.view(world, slot.chunk_numel)
    tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
    if pad:
        pad_shape = slot.shape[:slot.shard_dim] + (pad,) + slot.shape[slot.shard_dim + 1:]
        tensor = mint.cat([tensor, _zeros(pad_shape, tensor.dtype)], dim=slot.shard_dim)
    outer = math.prod(slot.shape[:slot.shard_dim])
    inner = slot.chunk_numel // (outer * slot.chunk_size)
    split = tensor.view(outer, world, slot.chunk_size * inner)
    return split.permute(1, 0, 2).contiguous().view(world, slot.chunk_numel)


def local_shard(full: ms.Tensor, slot: GradSlot, rank: int) -> ms.Tensor:
    """Rank ``rank``'s chunk of ``full`` as a new contiguous tensor of ``slot.chunk_shape``."""
    return chunk_rows(full, slot)[rank].contiguous().view(slot.chunk_shape)


def unshard(gathered: ms.Tensor, slot: GradSlot) -> ms.Tensor:
    """The full tensor (``slot.shape``) from the flat concatenation of every rank's chunk."""
    world, dim = slot.world_size, slot.shard_dim
    if dim == 0:
        padded = gathered.reshape(slot.padded_shape)
    else:
        outer = math.prod(slot.chunk_shape[:dim])
        inner = math.prod(slot.chunk_shape[dim:])
        blocks = gathered.reshape(world, outer, inner).permute(1, 0, 2)
        padded = blocks.contiguous().reshape(slot.padded_shape)
    if slot.shard_padding_numel == 0:
        return padded
    return padded.narrow(dim, 0, slot.shape[dim])


# -- internals -----------------------------------------------------------------------------------
def _put(lease: Lease, grads, layout: ReduceScatterLayout, add: bool, host: bool) -> Written:
    _check(lease, grads, layout)
    on_host = host and _host_applies(lease, grads, layout)
    if on_host:
        # asnumpy() waits for every queued op that writes the tensor (a pending poison fill, the
        # op that produced a gradient), so the NumPy write below is ordered after them.
        _host_write(lease, grads, layout, add=add)
    else:
        packed = _assemble(grads, layout)
        if add:
            packed = _add_once_rounded(lease.tensor, packed)
        overwrite(lease.tensor, packed)
    size = itemsize(lease.dtype)
    return Written(nbytes=layout.total_numel * size,
                   padding_bytes=0 if add else layout.padding_numel * size, on_host=on_host)


def _check(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> None:
    lease.tensor  # noqa: B018 - raises LeaseStateError on a released lease
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


def _add_once_rounded(bucket: ms.Tensor, packed: ms.Tensor) -> ms.Tensor:
    """``bucket + packed`` computed in the wider dtype and rounded once (as the NumPy path does)."""
    if packed.dtype == bucket.dtype:
        return mint.add(bucket, packed)
    return mint.add(bucket.astype(ms.float32), packed.astype(ms.float32))


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype) -> ms.Tensor:
    # Read-only filler for padding; cached because allocating it costs as much as a small op.
    return mint.zeros(shape, dtype=dtype)


def _assemble(grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> ms.Tensor:
    """The bucket's content as one flat tensor (the gradient itself for an identity layout)."""
    if layout.is_identity():
        return flat_view(grads[0])
    dtypes = {g.dtype for g in grads}
    dtype = dtypes.pop() if len(dtypes) == 1 else ms.float32   # mixed: cat needs one dtype
    grads = [g if g.dtype == dtype else g.astype(dtype) for g in grads]
    pieces = [_zeros((layout.world_size, length), dtype) if slot is None
              else chunk_rows(grads[slot.index], slot) for length, slot in layout.row_segments()]
    out = mint.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    return out.view(layout.total_numel)


def _host_applies(lease: Lease, grads, layout: ReduceScatterLayout) -> bool:
    return lease.pool.device == "CPU" and lease.dtype in HOST_DTYPES \
        and all(g.dtype in HOST_DTYPES for g in grads) \
        and all(slot.shard_dim == 0 for slot in layout.slots)


def _host_write(lease: Lease, grads, layout: ReduceScatterLayout, add: bool) -> None:
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
