"""gradpool: a pre-allocated, fenced gradient bucket pool for MindSpore FSDP reduce paths.

What users (and ``hyper_parallel``) import: the names of ``__all__``; the reduce path's usage is
in :mod:`gradpool.reducer`. The layers, bottom up, are listed and enforced in
``tests/test_architecture.py``; ``hyper_parallel`` and ``gradpool.app`` (model, training job, YAML
config, CLI, msrun launcher) sit on top. The ``TYPE_CHECKING`` imports below are the façade, every
exported name and where it lives; at run time each is imported on first use (PEP 562; the table
is read from those imports), so ``import gradpool.layout`` stays free of MindSpore.
"""
import ast
import importlib
from pathlib import Path
from typing import TYPE_CHECKING

__version__ = "0.1.0"

if TYPE_CHECKING:
    from gradpool.comm import (REDUCE_OPS, AscendHcclCommunicator, CommHandle, Communicator,
                               CompletedHandle, CpuMcclCommunicator, SingleProcessCommunicator,
                               check_reduce_op, communicator_for, init_distributed,
                               launched_by_msrun)
    from gradpool.device import (SUPPORTED_DEVICES, EventFence, device_target,
                                 fence_queued_work, on_real_device, real_device_target,
                                 return_free_host_memory, synchronize)
    from gradpool.dtypes import (DTYPE_NAMES, SUPPORTED_DTYPES, check_dtype, dtype_named,
                                 is_whole_storage, itemsize, nan_fill, overwrite, writable_view)
    from gradpool.errors import (ArgumentTypeError, BackwardNotRecordedError, CheckpointError,
                                 CollectiveError, CommError, FeatureNotProvidedError,
                                 ForeignLeaseError, GradientIntegrityError, GradPoolError,
                                 InPlaceOpError,
                                 InvalidArgumentError, InvalidFenceError, LayoutMismatchError,
                                 LeaseStateError, MeshGroupError, MetaDeviceError,
                                 NonFiniteNormError, PoolCapacityError,
                                 StateMismatchError, UnsupportedDtypeError,
                                 UnsupportedPatternError, check_bool, check_int,
                                 check_positive_number)
    from gradpool.exchange import all_sum, all_sum_ints, exchange_ints, exchange_values
    from gradpool.gathered import GatheredParam, GatheredStats
    from gradpool.layout import GradSlot, ReduceScatterLayout, fusion_groups
    from gradpool.pack import (Written, chunk_rows, flat_view, local_shard, row_tails,
                               shard_views, unshard, write_row_tails)
    from gradpool.writers import accumulate as accumulate_bucket
    from gradpool.writers import add_in_place, check_in_place_add
    from gradpool.writers import pack as pack_bucket
    from gradpool.writers import unpack_gathered
    from gradpool.pool import BucketPool, Fence, Lease, PoolStats, as_fence, fence_done
    from gradpool.reducer import GradReducer, PackedBucket, ReducerConfig, ReduceResult, RowTag
    from gradpool.runtime import (GradPoolConfig, Runtime, all_runtimes, build_runtime,
                                  default_pool_config, install_runtime, reset_runtimes,
                                  runtime_for, set_default_pool_config)


def _facade() -> dict[str, tuple[str, str]]:
    """``{exported name: (module, name there)}`` from the ``TYPE_CHECKING`` imports above."""
    tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body if isinstance(node, ast.If)
                 and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING")
    return {alias.asname or alias.name: (node.module, alias.name)
            for node in block.body if isinstance(node, ast.ImportFrom) for alias in node.names}


_SOURCE = _facade()
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
