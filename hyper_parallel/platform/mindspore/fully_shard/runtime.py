"""The process-wide pool and communicator that ``fully_shard`` units share, one per pool config."""
from __future__ import annotations

from dataclasses import dataclass

from gradpool.comm import Communicator, communicator_for, init_distributed
from gradpool.config import GradPoolConfig
from gradpool.device import device_target
from gradpool.pool import BucketPool


@dataclass
class Runtime:
    config: GradPoolConfig
    pool: BucketPool
    comm: Communicator


_RUNTIMES: dict[GradPoolConfig, Runtime] = {}


def runtime_for(config: GradPoolConfig) -> Runtime:
    """Units built with equal pool configs share one pool (nested units reuse buckets)."""
    runtime = _RUNTIMES.get(config)
    if runtime is None:
        init_distributed()
        device = device_target()
        pool = BucketPool(device=device, timed_copies=device != "Ascend", **config.pool_kwargs())
        runtime = Runtime(config, pool, communicator_for(device))
        _RUNTIMES[config] = runtime
    return runtime


def all_runtimes() -> list[Runtime]:
    return list(_RUNTIMES.values())


def reset_runtimes() -> None:
    """Forget every runtime (tests that build models with different communicators)."""
    _RUNTIMES.clear()
