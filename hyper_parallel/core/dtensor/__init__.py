"""Distributed tensors: placements, the layout of a managed parameter, ``DTensor``."""
from hyper_parallel.core.dtensor.dtensor import DTensor, SkipDTensorDispatch, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard

__all__ = ["DTensor", "SkipDTensorDispatch", "distribute_tensor", "Partial", "Placement",
           "Replicate", "Shard"]
