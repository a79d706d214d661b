"""Upstream-compatible ``fully_shard`` for MindSpore whose reduce path runs on gradpool buckets.

Names of upstream's surface for features gradpool does not provide (``PipelineStage``,
``shard_module``) import and raise :class:`gradpool.FeatureNotProvidedError` when used.
"""
from hyper_parallel.core.device_mesh import DeviceMesh, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor, SkipDTensorDispatch, distribute_tensor
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.core.fully_shard.api import HSDPModule, fully_shard, hsdp_sync_stream
from hyper_parallel.core.fully_shard.clip import clip_grad_norm_
from hyper_parallel.core.fully_shard.state_dict import (ShardedTensor, get_model_state_dict,
                                                        get_optimizer_state_dict,
                                                        set_model_state_dict,
                                                        set_optimizer_state_dict)
from hyper_parallel.core.pipeline_parallel import PipelineStage
from hyper_parallel.core.shard import shard_module

__all__ = ["fully_shard", "hsdp_sync_stream", "HSDPModule", "DeviceMesh", "init_device_mesh",
           "clip_grad_norm_", "get_model_state_dict", "set_model_state_dict",
           "get_optimizer_state_dict", "set_optimizer_state_dict", "ShardedTensor",
           "DTensor", "SkipDTensorDispatch", "distribute_tensor", "Partial", "Placement",
           "Replicate", "Shard", "PipelineStage", "shard_module"]
