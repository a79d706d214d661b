"""The rank arithmetic of device meshes, free of MindSpore (property-tested against NumPy).

A mesh is ``shape`` (its dims' sizes) and ``ranks``: the world ranks of its positions, flat and
row-major. Every function here takes the rank it is asked about explicitly, so it can be
checked for every rank of a job from one process.

* :func:`coordinates` / :func:`rank_at`: a rank's position and back;
* :func:`group_ranks`: the ranks that share a rank's coordinates on every dim but one (its
  communication group along that dim);
* :func:`submesh_ranks`: the ranks of the sub-mesh that keeps some dims and fixes the others at
  a rank's coordinates (``mesh["dp_replicate", "fsdp"]``);
* :func:`unflatten_shape`: one dim split into several (row-major, so the ranks keep their
  order); flattening keeps the ranks too, as one dim.
"""
from __future__ import annotations

import math
from typing import Sequence


def coordinates(shape: Sequence[int], ranks: Sequence[int], rank: int) -> tuple[int, ...]:
    """Where ``rank`` sits in the mesh (ValueError if it is not in ``ranks``)."""
    flat = list(ranks).index(rank)
    coords = []
    for size in reversed(shape):
        flat, coord = divmod(flat, size)
        coords.append(coord)
    return tuple(reversed(coords))


def rank_at(shape: Sequence[int], ranks: Sequence[int], coords: Sequence[int]) -> int:
    flat = 0
    for coord, size in zip(coords, shape):
        flat = flat * size + coord
    return ranks[flat]


def group_ranks(shape: Sequence[int], ranks: Sequence[int], dim: int,
                rank: int) -> tuple[int, ...]:
    """The ranks of ``rank``'s group along ``dim``, in mesh order."""
    return submesh_ranks(shape, ranks, (dim,), rank)


def submesh_ranks(shape: Sequence[int], ranks: Sequence[int], dims: Sequence[int],
                  rank: int) -> tuple[int, ...]:
    """The ranks of the sub-mesh keeping ``dims`` (in that order, row-major over their sizes),
    every other dim fixed at ``rank``'s coordinate."""
    mine = coordinates(shape, ranks, rank)
    sizes = [shape[d] for d in dims]
    out = []
    for flat in range(math.prod(sizes)):
        coords, rest = list(mine), flat
        for d, size in zip(reversed(dims), reversed(sizes)):
            rest, coords[d] = divmod(rest, size)
        out.append(rank_at(shape, ranks, coords))
    return tuple(out)


def unflatten_shape(shape: Sequence[int], dim: int, sizes: Sequence[int]) -> tuple[int, ...]:
    """``shape`` with ``dim`` replaced by ``sizes`` (whose product must be its size)."""
    if math.prod(sizes) != shape[dim]:
        raise ValueError(f"sizes {tuple(sizes)} multiply to {math.prod(sizes)}, not to the "
                         f"size {shape[dim]} of dim {dim}")
    return tuple(shape[:dim]) + tuple(sizes) + tuple(shape[dim + 1:])
