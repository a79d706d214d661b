"""Placement types accepted by ``shard_placement_fn``."""
from hyper_parallel.core.dtensor.placement_types import Replicate, Shard

__all__ = ["Replicate", "Shard"]
