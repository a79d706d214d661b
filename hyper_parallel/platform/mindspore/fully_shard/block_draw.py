"""Which parts of a row-major random draw, taken block by block, belong to one rank's chunk.

A sharded parameter whose initialiser continues its random stream across calls is drawn in
consecutive flat blocks of at most ``block`` elements (:mod:`.meta_init`): every block is drawn,
so the stream advances exactly as one draw of the whole parameter would, and only the elements
of this rank's chunk are kept. Pure index arithmetic, no MindSpore.

Rank ``r``'s chunk along ``shard_dim`` ``d`` of a ``shape`` tensor is rows ``[r * chunk_size,
r * chunk_size + valid)`` of dim ``d``: in the flattened full tensor that is one run of
``valid * inner`` elements per index of the dims before ``d`` (one run when ``d == 0``); in the
contiguous chunk (of ``chunk_shape``) the same runs start every ``chunk_size * inner`` elements.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Run:
    """``length`` consecutive elements at ``source`` in the flattened full tensor, kept at
    ``target`` in the flattened chunk."""

    source: int
    length: int
    target: int


@dataclass(frozen=True)
class Block:
    """One draw: ``length`` elements starting at ``start`` in the flattened full tensor, and the
    pieces of it this rank keeps: ``(offset in the block, offset in the chunk, length)``."""

    start: int
    length: int
    keep: tuple[tuple[int, int, int], ...]


def chunk_runs(shape: tuple, shard_dim: int, chunk_size: int, rank: int) -> list[Run]:
    """The runs of rank ``rank``'s real (unpadded) rows, in increasing source order."""
    dim = shape[shard_dim]
    start = rank * chunk_size
    valid = max(0, min(chunk_size, dim - start))
    inner = math.prod(shape[shard_dim + 1:])
    outer = math.prod(shape[:shard_dim])
    if valid == 0 or inner == 0:
        return []
    return [Run(source=(o * dim + start) * inner, length=valid * inner,
                target=o * chunk_size * inner) for o in range(outer)]


def blocks(numel: int, block: int, runs: list[Run]) -> Iterator[Block]:
    """Consecutive blocks of at most ``block`` elements covering ``[0, numel)``, each with the
    parts of ``runs`` (sorted by source, disjoint) that fall inside it."""
    if block < 1:
        raise ValueError(f"block must hold at least one element, got {block}")
    first = 0                                     # first run not yet wholly behind us
    for start in range(0, numel, block):
        end = min(start + block, numel)
        keep = []
        while first < len(runs) and runs[first].source + runs[first].length <= start:
            first += 1
        for run in runs[first:]:
            if run.source >= end:
                break
            lo, hi = max(start, run.source), min(end, run.source + run.length)
            keep.append((lo - start, run.target + lo - run.source, hi - lo))
        yield Block(start=start, length=end - start, keep=tuple(keep))
