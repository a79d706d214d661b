"""Placements a ``shard_placement_fn`` may return (same names as upstream)."""
from __future__ import annotations

from dataclasses import dataclass


class Placement:
    """Base of the placement types."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Shard a parameter along ``dim`` across the shard group."""

    dim: int = 0

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim


@dataclass(frozen=True)
class Replicate(Placement):
    """Keep a parameter whole on every rank."""

    def is_replicate(self) -> bool:
        return True
