"""Tensor-parallel sharding plans (not provided: the name raises when used)."""
from hyper_parallel.core.not_provided import TENSOR_PARALLEL, refused_class

ShardingPlan = refused_class("ShardingPlan", TENSOR_PARALLEL, __name__)
