"""What a reduce path needs, built from one :class:`GradPoolConfig`: a pool, a communicator and
reducers on them. Units built with equal configs share one runtime (:func:`runtime_for`), so nested
``fully_shard`` units reuse each other's buckets::

    runtime = runtime_for(GradPoolConfig(poison_on_release=True))
    reducer = runtime.reducer(reduce_dtype=ms.float32, comm_fusion=True)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Union

from gradpool.comm import (Communicator, SingleProcessCommunicator, communicator_for,
                           init_distributed)
from gradpool.device import real_device_target
from gradpool.errors import (ArgumentTypeError, InvalidArgumentError, check_bool, check_int,
                             check_positive_number)
from gradpool.pool import MAX_ALIGNMENT_BYTES, BucketPool
from gradpool.reducer import GradReducer, ReducerConfig

MIB = 1024 * 1024
UNIT_ORDER_MODES = (True, False, "strict")


def check_unit_order_mode(name: str, value) -> None:
    """``check_unit_order`` is True, False or ``"strict"``."""
    if isinstance(value, bool) or value == "strict":
        return
    raise ArgumentTypeError(f"{name} must be True, False or 'strict', got {value!r}; 'strict' "
                            "agrees before every unit collective (for hunting a hang)")


@dataclass(frozen=True)
class GradPoolConfig:
    """Pool options of a reduce path (what ``fully_shard(pool_config=...)`` takes).
    ``bucket_cap_mib``: largest fused bucket. ``max_buckets_in_flight``: buckets per dtype whose
    collective may still run before ``acquire`` waits for the oldest (None: no bound).
    ``alignment_bytes``: chunk alignment and bucket size granularity. ``zero_copy``: let the
    collective read a gradient in place when the layout allows. ``poison_on_release``: fill
    recycled buckets with NaN (debug). ``max_cached_mib``: cap on the pool's memory (None: none).
    ``verify_gradients``: checksum each gradient on arrival and after its reduce (debug).
    ``async_reduce``: in ``main_grad`` mode (``apply_grad_on_fp32_main_grad``) a unit's backward
    launches its reduce without waiting (False: it waits), results reaching ``main_grad`` when
    the unit after the next one launches its reduce (the last two at the end of backward). ``check_unit_order``: every ``fully_shard`` unit collective carries a tag
    naming its unit, compared on the device and read once at the end of each backward that
    reduced, so units run in a different order on the ranks are an error naming them, not mixed
    shards (no collective, no host read per unit); ``"strict"``: every rank agrees before each
    unit collective instead (a world all-gather read on the host: for hunting a hang);
    ``False``: no check. ``main_grad_in_place``:
    where the device adds in place (Ascend), ``main_grad += shard`` with ``Tensor.add_``, checked
    once per process to take effect (False: a new ``main_grad`` tensor per reduce)."""

    bucket_cap_mib: float = 25.0
    max_buckets_in_flight: Optional[int] = 2
    alignment_bytes: int = 512
    zero_copy: bool = False
    poison_on_release: bool = False
    max_cached_mib: Optional[float] = None
    verify_gradients: bool = False
    async_reduce: bool = True
    check_unit_order: Union[bool, str] = True
    main_grad_in_place: bool = True

    def __post_init__(self) -> None:
        for name in ("zero_copy", "poison_on_release", "verify_gradients", "async_reduce",
                     "main_grad_in_place"):
            check_bool(f"GradPoolConfig.{name}", getattr(self, name))
        check_unit_order_mode("GradPoolConfig.check_unit_order", self.check_unit_order)
        check_positive_number("GradPoolConfig.bucket_cap_mib", self.bucket_cap_mib)
        check_int("GradPoolConfig.max_buckets_in_flight", self.max_buckets_in_flight, 1,
                  nullable=True)
        check_positive_number("GradPoolConfig.max_cached_mib", self.max_cached_mib, nullable=True)
        check_int("GradPoolConfig.alignment_bytes", self.alignment_bytes, 4, MAX_ALIGNMENT_BYTES)
        if self.alignment_bytes % 4:
            raise InvalidArgumentError(f"GradPoolConfig.alignment_bytes must be a multiple of 4, "
                                       f"got {self.alignment_bytes!r}")
        # Sizes too small to hold one aligned element are typos, not configurations.
        if self.bucket_cap_bytes < self.alignment_bytes:
            raise InvalidArgumentError(
                f"GradPoolConfig.bucket_cap_mib = {self.bucket_cap_mib!r} is "
                f"{self.bucket_cap_bytes} bytes, less than one aligned chunk "
                f"(alignment_bytes = {self.alignment_bytes}); give it in MiB, e.g. 25")
        if self.max_cached_bytes is not None and self.max_cached_bytes < self.alignment_bytes:
            raise InvalidArgumentError(
                f"GradPoolConfig.max_cached_mib = {self.max_cached_mib!r} is "
                f"{self.max_cached_bytes} bytes, less than one aligned bucket "
                f"(alignment_bytes = {self.alignment_bytes}); give it in MiB, e.g. 1024")

    @property
    def bucket_cap_bytes(self) -> int:
        # ceil: any positive MiB must give at least one byte, never a zero-size cap.
        return math.ceil(self.bucket_cap_mib * MIB)

    @property
    def max_cached_bytes(self) -> Optional[int]:
        return None if self.max_cached_mib is None else math.ceil(self.max_cached_mib * MIB)

    def pool_kwargs(self) -> dict:
        """Keyword arguments of :class:`gradpool.pool.BucketPool` (all but the device's)."""
        return {"alignment_bytes": self.alignment_bytes, "max_cached_bytes": self.max_cached_bytes,
                "poison_on_release": self.poison_on_release,
                "max_buckets_in_flight": self.max_buckets_in_flight}


@dataclass
class Runtime:
    config: GradPoolConfig
    pool: BucketPool
    comm: Communicator
    _groups: dict = field(default_factory=dict)
    # Applied to each group's communicator when it is built (a test's recording or latency
    # network in front of every group, not only the world's): ``wrap(comm, group name)``.
    wrap: Optional[Callable[[Communicator, str], Communicator]] = None

    def reducer(self, reduce_dtype=None, comm_fusion: bool = False,
                comm: Optional[Communicator] = None,
                replicate_comm: Optional[Communicator] = None) -> GradReducer:
        """A reducer on this runtime's pool; over ``comm`` (default: the runtime's, every rank)
        and, for HSDP, ``replicate_comm``."""
        return GradReducer(self.pool, comm if comm is not None else self.comm, ReducerConfig(
            reduce_dtype=reduce_dtype, comm_fusion=comm_fusion,
            bucket_cap_mib=self.config.bucket_cap_mib, zero_copy=self.config.zero_copy),
            replicate_comm=replicate_comm)

    def group_comm(self, group: Optional[str]) -> Communicator:
        """The communicator of MindSpore group ``group`` (None: a group of this rank alone);
        the runtime's own for the world group. Built once per group."""
        from mindspore.communication import GlobalComm
        if group is None:
            return SingleProcessCommunicator()
        if group == GlobalComm.WORLD_COMM_GROUP:
            return self.comm
        comm = self._groups.get(group)
        if comm is None:
            comm = communicator_for(self.pool.device, group)
            if self.wrap is not None:
                comm = self.wrap(comm, group)
            self._groups[group] = comm
        return comm


def build_runtime(config: GradPoolConfig, comm: Optional[Communicator] = None,
                  wrap: Optional[Callable[[Communicator, str], Communicator]] = None) -> Runtime:
    """A new pool on this process's device and ``comm`` (None: :func:`communicator_for`, put
    behind ``wrap(comm, "world")`` when given; ``wrap`` then also fronts every group's)."""
    if not isinstance(config, GradPoolConfig):
        raise InvalidArgumentError(f"config must be a GradPoolConfig, got {config!r}")
    init_distributed()
    device = real_device_target()
    # Timing each copy synchronizes the device; on Ascend that would serialize copy and comm.
    pool = BucketPool(device=device, timed_copies=device != "Ascend", **config.pool_kwargs())
    if comm is None:
        comm = communicator_for(device)
        if wrap is not None:
            comm = wrap(comm, "world")
    return Runtime(config, pool, comm, wrap=wrap)


_RUNTIMES: dict[GradPoolConfig, Runtime] = {}
_DEFAULT_CONFIG: list[GradPoolConfig] = [GradPoolConfig()]


def set_default_pool_config(config: GradPoolConfig) -> GradPoolConfig:
    """Make ``config`` the pool options of every later ``fully_shard`` call that passes no
    ``pool_config``: how a framework that calls ``fully_shard`` itself (mindformers'
    ``apply_fsdp``) runs with ``verify_gradients`` or a cache cap, its code unchanged. Returns
    the previous default, to restore it."""
    if not isinstance(config, GradPoolConfig):
        raise InvalidArgumentError(
            f"set_default_pool_config takes a GradPoolConfig, got {type(config).__name__}")
    previous, _DEFAULT_CONFIG[0] = _DEFAULT_CONFIG[0], config
    return previous


def default_pool_config() -> GradPoolConfig:
    """The pool options ``fully_shard`` uses without ``pool_config`` (:func:`set_default_pool_config`)."""
    return _DEFAULT_CONFIG[0]


def runtime_for(config: GradPoolConfig) -> Runtime:
    """The process-wide runtime of ``config`` (built on first use)."""
    runtime = _RUNTIMES.get(config)
    if runtime is None:
        runtime = _RUNTIMES[config] = build_runtime(config)
    return runtime


def install_runtime(config: GradPoolConfig, comm: Optional[Communicator] = None,
                    wrap: Optional[Callable[[Communicator, str], Communicator]] = None) -> Runtime:
    """Build the process-wide runtime of ``config`` on ``comm`` (a test or benchmark network), or
    on this process's communicators each put behind ``wrap(comm, group name)`` (the world's
    named ``"world"``); refused when it exists already (its units would keep the old one)."""
    if config in _RUNTIMES:
        raise InvalidArgumentError(
            f"a runtime for {config!r} exists already; call reset_runtimes() first")
    if comm is None and wrap is None:
        raise InvalidArgumentError("install_runtime needs a communicator or a wrap")
    runtime = _RUNTIMES[config] = build_runtime(config, comm, wrap)
    return runtime


def all_runtimes() -> list[Runtime]:
    return list(_RUNTIMES.values())


def reset_runtimes() -> None:
    """Forget every runtime (tests that build models with different communicators)."""
    _RUNTIMES.clear()
