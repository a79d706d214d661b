"""Placements: how a tensor lies along each dim of a device mesh (same names as upstream).

``Shard(d)``: split along tensor dim ``d`` over that mesh dim; ``Replicate()``: whole on every
rank of it; ``Partial(op)``: every rank holds a partial value, the tensor is their reduction.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradpool import InvalidArgumentError

PARTIAL_OPS = ("sum", "avg", "max", "min")


class Placement:
    """Base of the placement types."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Shard along tensor dim ``dim`` across the ranks of a mesh dim."""

    dim: int = 0

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim


@dataclass(frozen=True)
class Replicate(Placement):
    """Whole on every rank of a mesh dim."""

    def is_replicate(self) -> bool:
        return True


@dataclass(frozen=True)
class Partial(Placement):
    """Every rank of a mesh dim holds a partial value; the tensor is their ``reduce_op``."""

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in PARTIAL_OPS:
            raise InvalidArgumentError(
                f"Partial(reduce_op={self.reduce_op!r}) is not supported; use one of {PARTIAL_OPS}")

    def is_partial(self) -> bool:
        return True
