"""Tensor-parallel sharding of modules (not provided: the names raise when used)."""
from hyper_parallel.core.not_provided import TENSOR_PARALLEL, refused_function

shard_module = refused_function("shard_module", TENSOR_PARALLEL, __name__)
