"""The writes into pool buckets (pack, accumulate), the shard views of an output bucket, and the
chunk geometry of one parameter (its local shard, and the full tensor back from all chunks).

MindSpore 2.10's CPU backend silently ignores ``copy_`` into a view at a non-zero offset, makes
``add_`` out-of-place, rejects slice-assignment into bfloat16 and has no pad kernel. So on this
**device path** (portable to Ascend) a pack writes each gradient's chunks straight into the
bucket's ``[W, row]`` grid by slice-assignment, every byte once and no bucket-sized tensor made
(:func:`_write_in_place`; ``tests/test_pack_device.py`` counts both); an identity layout's one
gradient is written straight from it; an accumulate assembles the packed gradients with one
``mint.cat`` (far cheaper per input than a slice-assignment per gradient,
docs/benchmarks/host-path.md#device-path-assembly), adds out of place and writes the sum back.

Each function returns what it wrote (the caller records statistics); caller tensors are only
ever read. They are the **device writer** (:data:`DEVICE`) of :mod:`gradpool.writers`; the host
writer (:mod:`gradpool.host`) writes a CPU pool's buckets through their host memory and shares
the checks and the chunk geometry here.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Sequence

import mindspore as ms
from mindspore import mint

from gradpool.device import device_target
from gradpool.dtypes import (check_dtype, is_supported_singleton, is_whole_storage, itemsize,
                             overwrite, writable_view)
from gradpool.errors import InvalidArgumentError, LayoutMismatchError
from gradpool.layout import GradSlot, ReduceScatterLayout
from gradpool.pool import Lease


class Written(NamedTuple):
    """What one pack or accumulate wrote into its bucket (a tuple: cheap to make per call)."""

    nbytes: int           # bytes written (padding included)
    padding_bytes: int    # of those, zero padding (none for an accumulate, which adds)
    on_host: bool         # written by NumPy (done on return), else device ops were queued


def pack(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> Written:
    """Write ``grads`` into ``lease`` per ``layout``: cast to the lease dtype, pad with zeros."""
    return _put(lease, grads, layout, add=False)


def accumulate(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> Written:
    """Add ``grads`` (packed per ``layout``) to what ``lease`` holds (a micro-step); the sum is
    computed in the wider dtype and rounded once into the bucket."""
    return _put(lease, grads, layout, add=True)


def shard_views(output: ms.Tensor, layout: ReduceScatterLayout) -> list[ms.Tensor]:
    """Each gradient's shard (of its ``chunk_shape``) as a view of ``output``, one rank's row;
    for an uneven shard dim the entries from ``slot.valid_length(rank)`` on are padding."""
    if output.shape != (layout.row_numel,):
        raise LayoutMismatchError(
            f"output has shape {output.shape}; the layout's row needs ({layout.row_numel},)")
    segments = layout.row_segments()
    parts = mint.split(output, [length for length, _ in segments]) if len(segments) > 1 \
        else (output,)
    return [part.view(slot.chunk_shape) for part, (_, slot) in zip(parts, segments)
            if slot is not None]


def write_row_tails(tensor: ms.Tensor, layout: ReduceScatterLayout, values: ms.Tensor,
                    allocation: ms.Tensor | None = None) -> None:
    """Every row's reserved tail of the bucket ``tensor`` (laid out as ``layout``) := ``values``
    (``layout.tail_numel`` elements of the bucket's dtype), by slice-assignment: queued device
    writes, no host read. ``allocation``: the flat memory ``tensor`` starts at (a lease's), which
    the CPU writes row by row, as the device pack does (:class:`_Grid`)."""
    if tuple(values.shape) != (layout.tail_numel,):
        raise LayoutMismatchError(f"tail values have shape {tuple(values.shape)}; the layout "
                                  f"reserves ({layout.tail_numel},) per row")
    by_rows = _writes_by_rows()
    grid = _Grid.over(allocation if by_rows and allocation is not None else tensor,
                      layout.world_size, layout.row_numel, by_rows)
    source = grid.writable(values.astype(tensor.dtype) if values.dtype != tensor.dtype else values)
    target = grid.flat if source.dtype != ms.int16 else grid._as_bits()   # pylint: disable=protected-access
    start, stop = layout.tail_offset, layout.tail_offset + layout.tail_numel
    if not by_rows:
        target.view(grid.shape)[:, start:stop] = source      # broadcast over the rows
        return
    for r in range(layout.world_size):
        target[r * layout.row_numel + start:r * layout.row_numel + stop] = source


def row_tail(row: ms.Tensor, layout: ReduceScatterLayout) -> ms.Tensor:
    """The reserved tail of one row (a reduce-scatter's output, an all-reduced bucket)."""
    return row[layout.tail_offset:layout.tail_offset + layout.tail_numel]


def row_tails(bucket: ms.Tensor, layout: ReduceScatterLayout) -> ms.Tensor:
    """Every row's reserved tail of an all-gathered ``[W, row]`` bucket, as ``[W, tail]``."""
    grid = bucket.view(layout.world_size, layout.row_numel)
    return grid[:, layout.tail_offset:layout.tail_offset + layout.tail_numel]


def flat_view(tensor: ms.Tensor) -> ms.Tensor:
    """``tensor`` as 1-D over the same memory (itself when 1-D; made contiguous first). A CPU
    tensor spanning its storage is aliased through its host memory, not a view op: PyNative queues
    a view op on its launch thread and whatever reads the view waits for that thread, all of a
    zero-copy borrow's cost (issue 12; docs/benchmarks/host-path.md#flat-views-on-cpu)."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    if tensor.ndim == 1:
        return tensor
    if tensor.device == "CPU" and is_whole_storage(tensor):
        return ms.from_numpy(tensor.asnumpy().reshape(-1))
    return _device_flat(tensor)


def _device_flat(tensor: ms.Tensor) -> ms.Tensor:
    """The device path's flat view (a view op), what it runs on Ascend."""
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
        flat = _device_flat(tensor)
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


def unpack_gathered(lease: Lease, layout: ReduceScatterLayout) -> list[ms.Tensor]:
    """The full tensor of each slot of an all-gather bucket laid out as ``layout`` (row ``r``:
    rank ``r``'s row, packed with :func:`pack` at world size 1), in new memory: the bucket may be
    recycled once the queued copies ran, while autograd still holds the tensors."""
    check_gathered(lease, layout)
    grid = lease.tensor.view(layout.world_size, layout.row_numel)
    flats = []
    for s in layout.slots:
        part = grid[:, s.offset:s.offset + s.chunk_numel]
        if part.is_contiguous():        # the whole bucket: copy, never hand it out
            fresh = mint.empty(layout.world_size * s.chunk_numel, dtype=lease.dtype)
            overwrite(fresh, part.reshape(-1))
            flats.append(fresh)
        else:
            flats.append(part.contiguous().view(layout.world_size * s.chunk_numel))
    return [unshard(flat, slot) for flat, slot in zip(flats, layout.slots)]


class _DeviceWriter:
    """This module's writes as a :class:`gradpool.writers.BucketWriter` (queued MindSpore ops)."""

    pack = staticmethod(pack)
    accumulate = staticmethod(accumulate)
    unpack_gathered = staticmethod(unpack_gathered)


DEVICE = _DeviceWriter()


# -- internals -----------------------------------------------------------------------------------
def _put(lease: Lease, grads, layout: ReduceScatterLayout, add: bool) -> Written:
    check_write(lease, grads, layout)
    if add:
        overwrite(lease.tensor, _add_once_rounded(lease.tensor, _assemble(grads, layout)))
    elif layout.is_identity():
        overwrite(lease.tensor, _device_flat(grads[0]))
    else:
        _write_in_place(lease, grads, layout)
    size = itemsize(lease.dtype)
    return Written(layout.total_numel * size, 0 if add else layout.padding_numel * size, False)


def check_write(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout) -> None:
    """What every writer checks before a pack or accumulate writes anything: a live lease of the
    layout's size, one materialized tensor per slot of its shape and a supported dtype."""
    lease.tensor  # noqa: B018 - raises LeaseStateError on a released lease
    if len(grads) != len(layout.slots):
        raise LayoutMismatchError(
            f"got {len(grads)} gradients for a layout of {len(layout.slots)}; pass one per slot")
    for slot, grad in zip(layout.slots, grads):
        check_tensor(slot.index, grad)
        shape = grad.shape
        if shape != slot.shape and tuple(shape) != slot.shape:   # MindSpore gives a tuple
            raise LayoutMismatchError(
                f"gradient {slot.index} has shape {tuple(shape)}; the layout expects "
                f"{slot.shape}")
        dtype = grad.dtype
        if not is_supported_singleton(dtype):
            check_dtype(dtype)
        if grad.init is not None:
            raise InvalidArgumentError(
                f"gradient {slot.index} is lazily initialized ({type(grad.init).__name__}) and "
                "has no memory yet; call its init_data() before packing it")
    if lease.numel != layout.total_numel:
        raise LayoutMismatchError(
            f"lease holds {lease.numel} elements; the layout needs {layout.total_numel}")


def check_gathered(lease: Lease, layout: ReduceScatterLayout) -> None:
    """What every writer checks before reading an all-gather bucket: a live lease of its size."""
    lease.tensor  # noqa: B018 - raises LeaseStateError on a released lease
    if lease.numel != layout.total_numel:
        raise LayoutMismatchError(
            f"lease holds {lease.numel} elements; the layout needs {layout.total_numel}")


def check_tensor(index: int, grad) -> None:
    """Raise :class:`InvalidArgumentError` unless gradient ``index`` is a MindSpore tensor."""
    if not isinstance(grad, ms.Tensor):
        raise InvalidArgumentError(
            f"gradient {index} is a {type(grad).__name__}, not a mindspore Tensor; convert it "
            "with mindspore.Tensor(...)")


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
        return _device_flat(grads[0])
    dtypes = {g.dtype for g in grads}
    dtype = dtypes.pop() if len(dtypes) == 1 else ms.float32   # mixed: cat needs one dtype
    grads = [g if g.dtype == dtype else g.astype(dtype) for g in grads]
    pieces = [_zeros((layout.world_size, length), dtype) if slot is None
              else chunk_rows(grads[slot.index], slot) for length, slot in layout.row_segments()]
    out = mint.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0]
    return out.view(layout.total_numel)


def _write_in_place(lease: Lease, grads, layout: ReduceScatterLayout) -> None:
    """The device pack in one pass, by slice-assignment (what lands in a view on CPU and Ascend
    alike). A gradient sharded on a dim other than 0 is first padded and permuted into chunk
    order (tensors of its padded size: the grid cannot take a permuted source in one write)."""
    grid = _Grid(lease, layout.world_size, layout.row_numel, by_rows=_writes_by_rows())
    start = 0
    for length, slot in layout.row_segments():
        columns = slice(start, start + length)
        start += length
        if slot is None:
            grid.fill_zero(slice(0, layout.world_size), columns)
        elif slot.shard_dim == 0:
            _write_dim0(grid, columns, grid.writable(grads[slot.index]), slot)
        else:
            grid.put(slice(0, layout.world_size), columns,
                     chunk_rows(grid.writable(grads[slot.index]), slot))


def _write_dim0(grid: "_Grid", columns: slice, grad: ms.Tensor, slot: GradSlot) -> None:
    """A dim-0 gradient's chunks are consecutive runs of its flat memory: row r takes
    ``[r * chunk, (r + 1) * chunk)``; whatever lies past the gradient's end is zero-filled."""
    flat, chunk = flat_view(grad), slot.chunk_numel
    full, rest = divmod(flat.numel(), chunk)
    if full:
        grid.put_runs(slice(0, full), columns.start, flat, chunk, chunk)
    if rest:
        grid.put_runs(slice(full, full + 1), columns.start, flat, chunk, rest)
        grid.fill_zero(slice(full, full + 1), slice(columns.start + rest, columns.stop))
        full += 1
    if full < slot.world_size:
        grid.fill_zero(slice(full, slot.world_size), columns)


def _writes_by_rows() -> bool:
    return device_target() == "CPU"


class _Grid:
    """A bucket seen as ``[W, row]``, written by slice-assignment: one strided write per block
    into the lease's view (Ascend), or one contiguous write per row into the pool's allocation
    (CPU: its strided copy kernel is far slower, and a slice-assignment into a view rewrites the
    whole view through its base: docs/benchmarks/host-path.md#device-pack-writes)."""

    def __init__(self, lease: Lease, world: int, row: int, by_rows: bool):
        self.row, self.by_rows = row, by_rows
        self.flat = lease.allocation if by_rows else lease.tensor
        self.shape = (world, row)
        self._bits = None            # the bucket as int16, made once (a dtype view is an op)

    @classmethod
    def over(cls, flat: ms.Tensor, world: int, row: int, by_rows: bool) -> "_Grid":
        """A grid over the flat tensor ``flat`` itself (not a lease)."""
        grid = cls.__new__(cls)
        grid.row, grid.by_rows, grid.flat, grid.shape, grid._bits = \
            row, by_rows, flat, (world, row), None
        return grid

    def _as_bits(self) -> ms.Tensor:
        if self._bits is None:
            self._bits = writable_view(self.flat)
        return self._bits

    def writable(self, grad: ms.Tensor) -> ms.Tensor:
        """``grad`` as :meth:`put` can write it. The CPU copy kernel takes no bfloat16: there a
        cast to or from it goes through one tensor of the gradient's size, and bfloat16 bits move
        as int16. Elsewhere the write itself casts."""
        dtype = self.flat.dtype
        if device_target() != "CPU" or (dtype != ms.bfloat16 and grad.dtype != ms.bfloat16):
            return grad
        return writable_view(grad if grad.dtype == dtype else grad.astype(dtype))

    def put_runs(self, rows: slice, column: int, flat: ms.Tensor, chunk: int, width: int) -> None:
        """Row r (in ``rows``) takes ``flat[r * chunk, r * chunk + width)`` at ``column``
        (``width < chunk`` only for a single row)."""
        first = rows.start * chunk
        if not self.by_rows:
            count = rows.stop - rows.start
            block = flat[first:first + (count - 1) * chunk + width].view(count, width)
            self.put(rows, slice(column, column + width), block)
            return
        target = self.flat if flat.dtype != ms.int16 else self._as_bits()
        for r in range(rows.start, rows.stop):
            at = r * self.row + column
            target[at:at + width] = flat[r * chunk:r * chunk + width]

    def put(self, rows: slice, columns: slice, source: ms.Tensor) -> None:
        """``grid[rows, columns] = source`` (a block of that shape, from :meth:`writable`)."""
        target = self.flat if source.dtype != ms.int16 else self._as_bits()
        if not self.by_rows:
            target.view(self.shape)[rows, columns] = source
            return
        for i, r in enumerate(range(rows.start, rows.stop)):
            at = r * self.row
            target[at + columns.start:at + columns.stop] = source[i]

    def fill_zero(self, rows: slice, columns: slice) -> None:
        target = self._as_bits() if self.flat.dtype == ms.bfloat16 else self.flat  # 0 is +0.0
        if not self.by_rows:
            target.view(self.shape)[rows, columns] = 0
            return
        for r in range(rows.start, rows.stop):
            at = r * self.row
            target[at + columns.start:at + columns.stop] = 0
