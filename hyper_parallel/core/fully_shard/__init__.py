"""fully_shard and its policies."""
from hyper_parallel.core.fully_shard.api import HSDPModule, fully_shard, hsdp_sync_stream
from hyper_parallel.core.fully_shard.clip import clip_grad_norm_
from hyper_parallel.core.fully_shard.utils import (CPUOffloadPolicy, MixedPrecisionPolicy,
                                                   OffloadPolicy)

__all__ = ["fully_shard", "HSDPModule", "hsdp_sync_stream", "MixedPrecisionPolicy",
           "OffloadPolicy", "CPUOffloadPolicy", "clip_grad_norm_"]
