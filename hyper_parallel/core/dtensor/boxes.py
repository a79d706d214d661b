"""Where the pieces of a tensor are: boxes in its global index space (pure Python).

A sharded tensor is saved as pieces, each the unpadded part one rank holds: a box of
``offsets`` and ``lengths`` per dim. Loading at another world size or mesh asks, for the box the
loading rank needs, which parts of which saved pieces to read (:func:`plan_reads`). The pieces of
one tensor never overlap (each element has one owner) and together cover it; :func:`check_cover`
proves that when an index is written.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from gradpool import CheckpointError, StateMismatchError


@dataclass(frozen=True)
class Box:
    """``[offsets[d], offsets[d] + lengths[d])`` along every dim ``d``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Box":
        return cls(tuple(0 for _ in shape), tuple(int(n) for n in shape))

    @property
    def numel(self) -> int:
        return math.prod(self.lengths)

    def slices(self, origin: Optional["Box"] = None) -> tuple[slice, ...]:
        """This box as slices, relative to ``origin``'s offsets (absolute without one)."""
        base = origin.offsets if origin is not None else (0,) * len(self.offsets)
        return tuple(slice(o - b, o - b + n) for o, n, b in zip(self.offsets, self.lengths, base))

    def intersect(self, other: "Box") -> Optional["Box"]:
        """The common part, or None when the boxes share no element."""
        starts = tuple(max(a, b) for a, b in zip(self.offsets, other.offsets))
        ends = tuple(min(a + m, b + n) for a, m, b, n in
                     zip(self.offsets, self.lengths, other.offsets, other.lengths))
        if any(e <= s for s, e in zip(starts, ends)):
            return None
        return Box(starts, tuple(e - s for s, e in zip(starts, ends)))


def shard_box(shape: Sequence[int], shard_dim: int, chunk_size: int, index: int) -> Box:
    """The unpadded part of shard ``index`` of a tensor split in chunks of ``chunk_size`` along
    ``shard_dim`` (the last chunks may be shorter, or empty)."""
    start = min(index * chunk_size, shape[shard_dim])
    length = min(chunk_size, shape[shard_dim] - start)
    offsets = [0] * len(shape)
    lengths = [int(n) for n in shape]
    offsets[shard_dim], lengths[shard_dim] = start, length
    return Box(tuple(offsets), tuple(lengths))


def plan_reads(name: str, shape: Sequence[int], target: Box,
               pieces: Sequence[Box]) -> list[tuple[int, Box]]:
    """``(piece index, part)`` for every saved piece that holds part of ``target``: reading each
    part from its piece and placing it at ``part.slices(target)`` fills ``target`` exactly."""
    if len(target.offsets) != len(shape) or any(
            o < 0 or o + n > d for o, n, d in zip(target.offsets, target.lengths, shape)):
        raise StateMismatchError(f"{name}: box {target} lies outside the tensor's shape {tuple(shape)}")
    reads = []
    covered = 0
    for index, piece in enumerate(pieces):
        part = piece.intersect(target)
        if part is not None:
            reads.append((index, part))
            covered += part.numel
    if covered != target.numel:
        raise StateMismatchError(
            f"{name}: the pieces given hold {covered} of the {target.numel} elements this rank "
            f"needs (offsets {target.offsets}, lengths {target.lengths}); a sharded state dict "
            "holds one rank's shards only: load a full state dict or a checkpoint "
            "(hyper_parallel.checkpoint.load) to change the world size or mesh")
    return reads


def check_cover(name: str, shape: Sequence[int], pieces: Sequence[Box]) -> None:
    """The pieces lie inside ``shape``, do not overlap and hold every element, else
    :class:`CheckpointError`."""
    whole = Box.whole(shape)
    for piece in pieces:
        if whole.intersect(piece) != piece and piece.numel:
            raise CheckpointError(f"{name}: piece {piece} lies outside the shape {tuple(shape)}")
    held_pieces = [p for p in pieces if p.numel]
    # Sweep along the dim the pieces are split on: a piece can only overlap the ones that start
    # before it ends there (linear for a tensor sharded along one dim, at thousands of ranks).
    if not shape and len(held_pieces) > 1:
        raise CheckpointError(f"{name}: {len(held_pieces)} pieces of one 0-d tensor")
    dim = max(range(len(shape)), key=lambda d: len({p.offsets[d] for p in held_pieces}),
              default=None)
    ordered = sorted(held_pieces, key=lambda p: p.offsets[dim]) if dim is not None else []
    for i, piece in enumerate(ordered):
        end = piece.offsets[dim] + piece.lengths[dim]
        for later in ordered[i + 1:]:
            if later.offsets[dim] >= end:
                break
            if piece.intersect(later) is not None:
                raise CheckpointError(f"{name}: pieces {piece} and {later} overlap")
    held = sum(p.numel for p in held_pieces)
    if held != whole.numel:
        raise CheckpointError(
            f"{name}: its pieces hold {held} of its {whole.numel} elements (shape {tuple(shape)})")
