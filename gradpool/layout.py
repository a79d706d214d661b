"""Where each gradient's rank-chunks sit in a reduce-scatter bucket. Pure Python, no MindSpore.

The input bucket of world size W is viewed as ``[W, row_numel]``. Row ``r`` holds, for every
gradient in order, its ``r``-th chunk along its shard dim, so one reduce-scatter of the flat
bucket leaves rank ``r`` with row ``r``: its contiguous shard of every gradient. Uneven shards:
the shard dim is zero-padded up to ``W * chunk_size`` (``chunk_size = ceil(d / W)``). Each chunk
starts at a multiple of ``alignment`` elements inside its row, whose length is a multiple of it
too. A chunk along a shard dim other than 0 is stored contiguously, of shape ``chunk_shape``.

A layout may reserve ``tail_numel`` elements at the end of every row, after the last chunk and
before the row's alignment padding, for its caller's own values (``fully_shard``'s unit-order tag
rides there); the writers zero them like any gap, and no shard view covers them.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Sequence

from gradpool.errors import InvalidArgumentError, check_int

Shape = tuple[int, ...]


def ceil_div(value: int, divisor: int) -> int:
    return -(-value // divisor)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple`` (bucket sizes, aligned offsets)."""
    return ceil_div(value, multiple) * multiple


@dataclass(frozen=True)
class GradSlot:
    """One gradient's place in the bucket (offsets in elements)."""

    index: int
    shape: Shape
    shard_dim: int
    chunk_size: int      # length of the shard dim in one rank's chunk (ceil(d / W))
    offset: int          # where this gradient's chunk starts inside each row
    world_size: int

    @classmethod
    def of(cls, shape: Sequence[int], world_size: int, shard_dim: int = 0) -> "GradSlot":
        """The chunk geometry of a ``shape`` tensor sharded ``world_size`` ways on ``shard_dim``."""
        return ReduceScatterLayout.build([shape], world_size, 1, [shard_dim]).slots[0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def chunk_shape(self) -> Shape:
        return self.shape[: self.shard_dim] + (self.chunk_size,) + self.shape[self.shard_dim + 1:]

    @property
    def chunk_numel(self) -> int:
        return math.prod(self.chunk_shape)

    @property
    def padded_shape(self) -> Shape:
        """The gradient's shape with the shard dim padded to ``W * chunk_size``."""
        return self.shape[: self.shard_dim] + (self.chunk_size * self.world_size,) \
            + self.shape[self.shard_dim + 1:]

    @property
    def shard_padding_numel(self) -> int:
        """Elements added to make the shard dim divisible by W."""
        return self.chunk_numel * self.world_size - self.numel

    def valid_length(self, rank: int) -> int:
        """How many entries of ``rank``'s chunk along the shard dim are real gradient (not pad)."""
        start = rank * self.chunk_size
        return max(0, min(self.chunk_size, self.shape[self.shard_dim] - start))

    @property
    def shard_range(self) -> tuple[int, int]:
        """[start, end) of this gradient's shard inside one rank's output row."""
        return self.offset, self.offset + self.chunk_numel


@dataclass(frozen=True)
class ReduceScatterLayout:
    """A frozen plan for one bucket: build it with :meth:`build`."""

    world_size: int
    alignment: int
    slots: tuple[GradSlot, ...]
    row_numel: int
    tail_numel: int = 0
    tail_offset: int = 0     # where the reserved tail starts inside each row

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], world_size: int, alignment: int = 1,
              shard_dims: Sequence[int] | None = None,
              tail_numel: int = 0) -> "ReduceScatterLayout":
        """``tail_numel``: elements reserved at the end of every row (see the module's doc)."""
        check_int("world_size", world_size, 1)
        check_int("alignment", alignment, 1)   # in elements
        check_int("tail_numel", tail_numel, 0)
        shapes = [tuple(s) for s in shapes]
        if not shapes:
            raise InvalidArgumentError("a layout needs at least one gradient shape, got an empty list")
        if shard_dims is None:
            shard_dims = [0] * len(shapes)
        if len(shard_dims) != len(shapes):
            raise InvalidArgumentError(
                f"shard_dims has {len(shard_dims)} entries for {len(shapes)} shapes; give one per shape")
        slots = []
        cursor = 0
        for index, (shape, dim) in enumerate(zip(shapes, shard_dims)):
            for d in shape:
                check_int(f"gradient {index}'s shape {shape} entry", d, 1)
            check_int(f"gradient {index}'s shard dim", dim, 0)
            if len(shape) == 0:
                raise InvalidArgumentError(
                    f"gradient {index} has shape {shape}; shapes need >= 1 dim and every dim >= 1")
            if not 0 <= dim < len(shape):
                raise InvalidArgumentError(
                    f"gradient {index} of shape {shape} cannot be sharded on dim {dim}")
            cursor = round_up(cursor, alignment)
            slot = GradSlot(index=index, shape=shape, shard_dim=dim,
                            chunk_size=ceil_div(shape[dim], world_size), offset=cursor,
                            world_size=world_size)
            slots.append(slot)
            cursor += slot.chunk_numel
        return cls(world_size=world_size, alignment=alignment, slots=tuple(slots),
                   row_numel=round_up(cursor + tail_numel, alignment), tail_numel=tail_numel,
                   tail_offset=cursor)

    # Cached on the (frozen) instance: every pack asks, and computing them sums over the slots.
    @functools.cached_property
    def total_numel(self) -> int:
        """Elements in the whole input bucket (``W * row_numel``)."""
        return self.world_size * self.row_numel

    @functools.cached_property
    def data_numel(self) -> int:
        """Elements of real gradient data in the bucket."""
        return sum(slot.numel for slot in self.slots)

    @functools.cached_property
    def padding_numel(self) -> int:
        """Elements of the bucket that hold no gradient (uneven-shard rows and alignment gaps)."""
        return self.total_numel - self.data_numel

    def flat_range(self, index: int, rank: int) -> tuple[int, int]:
        """Flat [start, end) in the input bucket of gradient ``index``'s ``rank``-th chunk."""
        slot = self.slots[index]
        base = rank * self.row_numel + slot.offset
        return base, base + slot.chunk_numel

    def row_segments(self) -> tuple[tuple[int, Optional[GradSlot]], ...]:
        """One row, in order, as ``(length, slot)`` pieces; ``slot`` is None for a gap (an
        alignment gap or the row's tail), which holds zeros."""
        out: list[tuple[int, Optional[GradSlot]]] = []
        cursor = 0
        for slot in self.slots:
            if slot.offset > cursor:
                out.append((slot.offset - cursor, None))
            out.append((slot.chunk_numel, slot))
            cursor = slot.offset + slot.chunk_numel
        if self.row_numel > cursor:
            out.append((self.row_numel - cursor, None))
        return tuple(out)

    def gaps(self) -> tuple[tuple[int, int], ...]:
        """In-row [start, end) ranges that belong to no gradient (alignment gaps and row tail)."""
        out, start = [], 0
        for length, slot in self.row_segments():
            if slot is None:
                out.append((start, start + length))
            start += length
        return tuple(out)

    def is_identity(self) -> bool:
        """True when the bucket is byte-for-byte the flat gradient: one gradient, shard dim 0,
        evenly divisible, no alignment gap. Only then can a collective read a gradient in place."""
        return self._identity

    @functools.cached_property
    def identity_shape(self) -> Optional[tuple[int, ...]]:
        """The one gradient's shape when :meth:`is_identity`, else None (one read per pack)."""
        return self.slots[0].shape if self._identity else None

    @functools.cached_property
    def _identity(self) -> bool:
        if len(self.slots) != 1:
            return False
        return self.slots[0].shard_dim == 0 and self.padding_numel == 0


def fusion_groups(items: Sequence[tuple[object, int]], cap_bytes: float,
                  fused: bool = True) -> list[tuple[object, list[int]]]:
    """Which gradients share a bucket (for the reducer and the memory plan): ``items`` are
    ``(reduce dtype, bytes)`` in gradient order; the result is ``(dtype, indices)`` per bucket, in
    the order the buckets open. Not ``fused``: one bucket each. Fused: gradients join their
    dtype's open bucket until the next would pass ``cap_bytes`` (a larger one gets its own)."""
    if not fused:
        return [(dtype, [i]) for i, (dtype, _) in enumerate(items)]
    groups: list[tuple[object, list[int]]] = []
    open_group: dict = {}                  # dtype -> [index into groups, bytes so far]
    for i, (dtype, nbytes) in enumerate(items):
        current = open_group.get(dtype)
        if current is None or (current[1] and current[1] + nbytes > cap_bytes):
            current = [len(groups), 0]
            groups.append((dtype, []))
            open_group[dtype] = current
        groups[current[0]][1].append(i)
        current[1] += nbytes
    return groups
