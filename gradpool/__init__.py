"""gradpool: a pre-allocated, fenced gradient bucket pool for MindSpore FSDP reduce paths.

What users (and ``hyper_parallel``) import::

    from gradpool import BucketPool, GradReducer, ReducerConfig, SingleProcessCommunicator
    pool = BucketPool()
    reducer = GradReducer(pool, SingleProcessCommunicator(), ReducerConfig(comm_fusion=True))
    result = reducer.reduce_scatter(grads)
    shards = result.wait()          # one shard view per gradient
    result.release()                # output buckets back to the pool

Layers, bottom up (``tests/test_architecture.py`` keeps the arrows pointing down):
``errors``, ``layout`` (pure Python) and ``dtypes``, ``device`` -> ``pool`` | ``comm`` |
``gathered`` (siblings) -> ``pack`` -> ``reducer`` -> ``runtime`` -> ``testing``; ``hyper_parallel`` and
``gradpool.app`` (model, training job, YAML config, CLI, msrun launcher) sit on top.

Names resolve on first use, so ``import gradpool.layout`` stays free of MindSpore.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "gradpool.pool": ("BucketPool", "Lease", "PoolStats", "Fence", "fence_done", "as_fence"),
    "gradpool.layout": ("ReduceScatterLayout", "GradSlot"),
    "gradpool.gathered": ("GatheredParam", "GatheredStats"),
    "gradpool.pack": ("chunk_rows", "local_shard", "unshard", "shard_views", "flat_view",
                      "unpack_gathered", "Written"),
    "gradpool.reducer": ("GradReducer", "ReducerConfig", "ReduceResult", "PackedBucket"),
    "gradpool.runtime": ("GradPoolConfig", "Runtime", "build_runtime", "runtime_for",
                         "all_runtimes", "reset_runtimes", "install_runtime"),
    "gradpool.comm": ("Communicator", "CommHandle", "CompletedHandle",
                      "SingleProcessCommunicator", "CpuMcclCommunicator",
                      "AscendHcclCommunicator", "communicator_for", "init_distributed",
                      "launched_by_msrun", "check_reduce_op", "REDUCE_OPS"),
    "gradpool.dtypes": ("SUPPORTED_DTYPES", "DTYPE_NAMES", "check_dtype", "dtype_named",
                        "itemsize", "overwrite", "writable_view", "nan_fill"),
    "gradpool.device": ("SUPPORTED_DEVICES", "device_target", "synchronize"),
    "gradpool.errors": ("GradPoolError", "InvalidArgumentError", "UnsupportedDtypeError",
                        "LayoutMismatchError", "LeaseStateError", "ForeignLeaseError", "InvalidFenceError",
                        "PoolCapacityError", "CommError", "LaunchError", "ConfigError",
                        "ConfigValueError", "UnknownConfigKeyError", "OverrideSyntaxError",
                        "GradientIntegrityError", "NonFiniteNormError", "CheckpointError",
                        "StateMismatchError", "ArgumentTypeError",
                        "check_bool", "check_int", "check_positive_number"),
}
# Names that would shadow the submodule they live in (``gradpool.pack``) go out under another.
_RENAMED = {"pack_bucket": ("gradpool.pack", "pack"),
            "accumulate_bucket": ("gradpool.pack", "accumulate")}
_SOURCE = {**{name: (module, name) for module, names in _EXPORTS.items() for name in names},
           **_RENAMED}

__all__ = [*_SOURCE, "__version__"]


def __getattr__(name: str):
    source = _SOURCE.get(name)
    if source is None:
        raise AttributeError(f"module 'gradpool' has no attribute {name!r}")
    value = getattr(importlib.import_module(source[0]), source[1])
    globals()[name] = value       # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
