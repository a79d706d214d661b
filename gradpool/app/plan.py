"""``gradpool plan``: the per-rank memory a run's reduce path takes, before renting the cards.

Usage::

    plan = plan_memory(load_config("configs/deepseek3_671b_910b.yaml"))
    print(format_plan(plan))                 # the table
    json.dumps(plan.to_dict())               # the same numbers, in bytes

Nothing here builds the model or touches a device: parameter shapes come from
:func:`gradpool.app.model.parameter_specs` (``ModelConfig`` alone), bucket geometry from
:class:`gradpool.layout.ReduceScatterLayout` (the layouts the reducer builds), and the pool's
buckets from a *replay*: the acquire/release sequence ``gradpool train`` makes in two training
steps (zero_grad, the forward's fused all-gathers, each unit's reduce in backward order, the
root's drain), run against a bookkeeping-only model of :class:`gradpool.pool.BucketPool`'s policy
(smallest free bucket that fits, else a new one rounded up to the alignment; a released bucket
is reusable once its fence has completed; at ``max_buckets_in_flight`` fenced buckets of a dtype
``acquire`` first waits for the oldest). Why a replay and not a formula: buckets change roles
between steps (an output bucket of step 1 serves an input in step 2) and the pool grows by
running maxima, so only the sequence gives the high-water. The synchronous reduce gives a unit's
output buckets back in its own backward (added into ``main_grad``, or copied into gradients
autograd owns: pool memory never leaves the pool); the replay holds the asynchronous reduce's
outputs until the end of the step, and HSDP's all-reduced partial sums until the next
``zero_grad``, where the real pool may give them back earlier, so for those the replay is an
upper bound (tests/test_plan.py finds the tiny model within its 3 % tolerance). ``tests/test_plan.py`` checks it
against the real pool's measured high-water on the tiny model, so a change to the pool's policy
that this model does not follow fails a test.

Fences: on CPU every collective has completed when it returns (MindSpore's CPU collectives are
synchronous), so a released input bucket is free at once. On Ascend a fence counts as in flight
until the unit's backward waits on it (MindSpore's ``CommHandle`` has no ``is_completed()``), so
up to ``max_buckets_in_flight`` input buckets are held at once; HSDP waits for each
reduce-scatter before its replicate all-reduce, which completes the fence right away.

Side by side, for the same step (same buckets, same padding):

* **upstream** per-step allocation (PyTorch FSDP2 / upstream hyper_parallel): every input and
  output is allocated fresh each step, an input freed when its collective completes, an output
  once the unit's shards reached ``main_grad``; no bound on what is in flight, so a unit's
  inputs and outputs are alive together. Its transient peak is the largest unit's sum; a caching
  allocator holds at least that (fragmentation not counted).
* **Megatron-style** persistent gradient buffer: every parameter's full gradient at once, in the
  ``main_grad`` dtype, each parameter starting on a 64-element boundary, each bucket (here: a
  ``fully_shard`` unit) ending on a multiple of lcm(shard group, 128); reduce-scattered in place,
  so nothing is copied, and ``main_grad`` is a view of it.

The copy time is an estimate, not a measurement: bytes the pool reads and writes per step
divided by ``hbm_gbps * copy_efficiency``. Its default is the 910B's commonly published HBM2e
bandwidth, 1.6 TB/s (four HBM2e stacks at 3.2 Gb/s per pin give ~1.64 TB/s), at 0.7 of peak, an
assumed fraction for a streaming copy kernel; both can be set. No 910B run has measured it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from gradpool.app.config import RunConfig
from gradpool.app.model import ParamSpec, parameter_specs
from gradpool.errors import InvalidArgumentError, check_positive_number
from gradpool.layout import ReduceScatterLayout, fusion_groups, round_up
from gradpool.reuse import FREE, FreeIndex

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
HBM_910B_GBPS = 1600.0          # GB/s, the figure commonly published for the 910B's HBM2e
COPY_EFFICIENCY = 0.7           # assumed fraction of peak a copy kernel reaches (not measured)
DEVICE_MEMORY_GIB = {"Ascend": 64.0}     # the 910B's HBM; CPU: none assumed
MEGATRON_PARAM_ALIGN = 64       # elements (Megatron-Core's param_and_grad_buffer)
MEGATRON_BUCKET_ALIGN = 128
HCCL_DEFAULT_BUFFSIZE_MIB = 200  # CANN's HCCL_BUFFSIZE default, per communicator and direction
MIB, GIB = 2 ** 20, 2 ** 30


@dataclass(frozen=True)
class PlanOptions:
    """``hbm_gbps`` (GB/s) and ``copy_efficiency`` set the copy-time estimate;
    ``device_memory_gib`` the card the totals are compared with (None: 64 on Ascend, none on
    CPU)."""

    hbm_gbps: float = HBM_910B_GBPS
    copy_efficiency: float = COPY_EFFICIENCY
    device_memory_gib: Optional[float] = None

    def __post_init__(self) -> None:
        check_positive_number("hbm_gbps", self.hbm_gbps)
        check_positive_number("copy_efficiency", self.copy_efficiency)
        if self.copy_efficiency > 1:
            raise InvalidArgumentError(
                f"copy_efficiency is a fraction of peak bandwidth, at most 1; got "
                f"{self.copy_efficiency!r}")
        check_positive_number("device_memory_gib", self.device_memory_gib, nullable=True)


# -- the pool replay ---------------------------------------------------------------------------
@dataclass(eq=False)
class _Bucket:
    index: int                   # allocation order (the pool breaks capacity ties by it)
    dtype: str
    capacity: int                # elements
    state: str = FREE            # free | leased | fenced
    handle: Optional[int] = None

    @property
    def nbytes(self) -> int:
        return self.capacity * ITEMSIZE[self.dtype]


class _PoolReplay:
    """BucketPool's bookkeeping without memory: the same bucket for every acquire.

    The bucket reused is the pool's own rule (:mod:`gradpool.reuse`), in its indexed form so that
    a 671B plan (tens of thousands of buckets) replays in seconds; fenced buckets are kept in
    release order per dtype. A fence is recycled as soon as its handle completes; the pool does
    it lazily (at its next acquire or stats), which chooses the same buckets, since nothing in
    between looks at them."""

    def __init__(self, alignment_bytes: int, max_in_flight: Optional[int]):
        self.alignment_bytes = alignment_bytes
        self.max_in_flight = max_in_flight
        self.buckets: list[_Bucket] = []
        self.reserved = 0
        self.high_water = 0
        self.new_allocations = 0
        self.stalls = 0
        self.fenced_bytes = 0
        self._free = FreeIndex()
        self._fenced: dict = {}          # dtype -> {bucket index: None}, oldest first
        self._on_handle: dict = {}       # handle -> [bucket], fenced on it
        self._done: set[int] = set()
        self._handles = 0

    def align(self, dtype: str) -> int:
        return max(1, self.alignment_bytes // ITEMSIZE[dtype])

    def handle(self, completed: bool) -> int:
        self._handles += 1
        if completed:
            self._done.add(self._handles)
        return self._handles

    def complete(self, handle: int) -> None:
        self._done.add(handle)
        for bucket in self._on_handle.pop(handle, ()):
            self._recycle(bucket)

    def acquire(self, numel: int, dtype: str) -> _Bucket:
        fenced = self._fenced.setdefault(dtype, {})
        while self.max_in_flight is not None and len(fenced) >= self.max_in_flight:
            oldest = self.buckets[next(iter(fenced))]
            self.stalls += 1                     # the pool waits on the oldest fence
            self.complete(oldest.handle)
        bucket = self._free.take(numel, dtype)
        if bucket is None:
            bucket = _Bucket(len(self.buckets), dtype, round_up(numel, self.align(dtype)))
            self.buckets.append(bucket)
            self.reserved += bucket.nbytes
            self.new_allocations += 1
            self.high_water = max(self.high_water, self.reserved)
        bucket.state = "leased"
        return bucket

    def release(self, bucket: _Bucket, handle: Optional[int] = None) -> None:
        if handle is None or handle in self._done:
            self._recycle(bucket)
            return
        bucket.state, bucket.handle = "fenced", handle
        self._fenced.setdefault(bucket.dtype, {})[bucket.index] = None
        self._on_handle.setdefault(handle, []).append(bucket)
        self.fenced_bytes += bucket.nbytes

    def wait_all(self) -> None:
        for handle in list(self._on_handle):
            self.complete(handle)

    def _recycle(self, bucket: _Bucket) -> None:
        if bucket.state == "fenced":
            del self._fenced[bucket.dtype][bucket.index]
            self.fenced_bytes -= bucket.nbytes
        if bucket.state != FREE:
            self._free.add(bucket, bucket.index)
        bucket.state, bucket.handle = FREE, None


# -- the run's geometry ------------------------------------------------------------------------
@dataclass(frozen=True)
class _Reduce:
    """One reduce bucket: its parameters and the layout the reducer builds for them."""

    specs: tuple
    layout: ReduceScatterLayout


@dataclass(frozen=True)
class _Unit:
    name: str
    specs: tuple
    reduces: tuple               # of _Reduce, in launch order
    gather: Optional[tuple]      # (send numel, recv numel) of the fused all-gather, or None


@dataclass
class _Geometry:
    replicas: int
    shards: int
    compute_dtype: str           # gathered parameters and autograd's gradients
    reduce_dtype: str
    units: list                  # forward order: root first, then the layers


def _dtype(name: Optional[str], default: str) -> str:
    return name if name is not None else default


def _groups(specs: list, nbytes_each: int, cap_bytes: float, fused: bool) -> list:
    """Parameters per bucket, by the reducer's own rule (:func:`gradpool.layout.fusion_groups`; one
    reduce dtype per call here)."""
    groups = fusion_groups([(None, s.numel * nbytes_each) for s in specs], cap_bytes, fused)
    return [[specs[i] for i in indices] for _, indices in groups]


def _mesh(cfg: RunConfig) -> tuple[int, int]:
    shape = cfg.fully_shard.mesh_shape
    if shape is None:
        return 1, cfg.launch.ranks
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], shape[1]


def _geometry(cfg: RunConfig, specs: Optional[list] = None) -> _Geometry:
    replicas, shards = _mesh(cfg)
    fs, pool = cfg.fully_shard, cfg.gradpool
    compute = _dtype(fs.param_dtype, "float32")       # the model's parameters are float32
    reduce = _dtype(fs.reduce_dtype, compute)
    align = max(1, pool.alignment_bytes // ITEMSIZE[reduce])
    align32 = max(1, pool.alignment_bytes // ITEMSIZE["float32"])
    by_unit: dict = {}
    for spec in specs if specs is not None else parameter_specs(cfg.model):
        by_unit.setdefault(spec.unit, []).append(spec)
    names = ["root"] + sorted((name for name in by_unit if name != "root"),
                              key=lambda name: int(name.split(".")[1]))
    units = []
    for name in names:
        specs = by_unit[name]
        reduces = tuple(
            _Reduce(tuple(group), ReduceScatterLayout.build([s.shape for s in group], shards,
                                                            align))
            for group in _groups(specs, ITEMSIZE[reduce], pool.bucket_cap_mib * MIB,
                                 fs.comm_fusion))
        gather = None
        if fs.comm_fusion and shards > 1:
            # launch_all_gather: one send row of the local shards, one [W, row] receive bucket,
            # in the shards' own dtype (float32), at the same alignment as a reduce bucket
            full = ReduceScatterLayout.build([s.shape for s in specs], shards, align32)
            row = ReduceScatterLayout.build([slot.chunk_shape for slot in full.slots], 1,
                                            align32)
            gather = (row.total_numel, full.total_numel)
        units.append(_Unit(name, tuple(specs), reduces, gather))
    return _Geometry(replicas, shards, compute, reduce, units)


# -- one training step, as gradpool train makes it ---------------------------------------------
@dataclass
class _StepCounts:
    bytes_copied: int = 0        # written into buckets (padding included): the pool's stat
    bytes_read: int = 0          # read from autograd's gradients (for the time estimate)
    padding_bytes: int = 0
    input_peak: int = 0          # most bytes held by input buckets (leased or fenced) at once
    output_bytes: int = 0        # output buckets held at the end of backward


class _StepReplay:
    def __init__(self, cfg: RunConfig, geo: _Geometry, pool: _PoolReplay):
        self.cfg, self.geo, self.pool = cfg, geo, pool
        self.device_fences = cfg.launch.device == "Ascend"
        self.hsdp = geo.replicas > 1
        micro = cfg.train.micro_steps
        every = cfg.fully_shard.all_reduce_every_micro_step
        # a unit's output buckets go back in its own backward (synchronous: added into main_grad,
        # or copied into tensors autograd owns) or when the root's backward drains the reduces
        # (asynchronous, main_grad mode only)
        self.main_grad = cfg.fully_shard.apply_grad_on_fp32_main_grad
        self.async_reduce = self.main_grad and cfg.gradpool.async_reduce
        # set_requires_gradient_sync(last): micro-steps packed into the units' buckets, one reduce
        self.accumulate = micro > 1 and every
        # HSDP set_requires_all_reduce(last): reduce-scatter each micro-step, all-reduce the sums
        self.partials = micro > 1 and self.hsdp and not every
        self.outputs: list = []
        self.counts = _StepCounts()
        self._input_bytes = 0

    def run(self) -> _StepCounts:
        self.counts = _StepCounts()
        for bucket in self.outputs:          # model.zero_grad(): every unit's outputs go back
            self.pool.release(bucket)
        self.outputs = []
        micro = self.cfg.train.micro_steps
        accumulate, partials = self.accumulate, self.partials
        pending: dict = {}
        for index in range(micro):
            last = index == micro - 1
            self._forward()
            for unit in reversed(self.geo.units[1:]):       # the layers, last one first
                self._backward(unit, index, last, accumulate, partials, pending)
            self._backward(self.geo.units[0], index, last, accumulate, partials, pending)
            self.pool.wait_all()             # the root's backward ends the step
            if self.main_grad and not partials:
                for bucket in self.outputs:  # drained into main_grad
                    self.pool.release(bucket)
                self.outputs = []
        self.counts.output_bytes = sum(b.nbytes for b in self.outputs)
        return self.counts

    def _forward(self) -> None:
        for unit in self.geo.units:          # the root's gather runs first, then each layer's
            if unit.gather is None:
                continue
            send = self.pool.acquire(unit.gather[0], "float32")
            recv = self.pool.acquire(unit.gather[1], "float32")
            self.pool.release(send)
            self.pool.release(recv)

    def _backward(self, unit: _Unit, index: int, last: bool, accumulate: bool, partials: bool,
                  pending: dict) -> None:
        reduce = self.geo.reduce_dtype
        if accumulate and not last:
            if index == 0:                   # pack once, then add into the same buckets
                pending[unit.name] = [self._input(r) for r in unit.reduces]
            else:
                for r in unit.reduces:
                    self._copy(r.layout, reduce, padding=False)
            return
        handles = []
        if accumulate:                       # the last micro-step adds, then launches
            inputs = pending.pop(unit.name)
            for r in unit.reduces:
                self._copy(r.layout, reduce, padding=False)
        else:
            inputs = None
        outs = []
        for position, r in enumerate(unit.reduces):
            bucket = inputs[position] if inputs is not None else self._input(r)
            out = self.pool.acquire(r.layout.row_numel, reduce)
            handle = self.pool.handle(completed=not self.device_fences)
            self.pool.release(bucket, handle)
            self._input_bytes -= bucket.nbytes
            if self.hsdp and not partials:
                self.pool.complete(handle)   # waited before the replicate all-reduce
            handles.append(handle)
            outs.append(out)
        for handle in handles:               # the unit's backward reads its shards
            self.pool.complete(handle)
        if partials:
            for out in outs:                 # read into the kept partial sums, then released
                self.pool.release(out)
            if last:
                self._all_reduce_partials(unit)
            return
        if not self.async_reduce:
            for out in outs:                 # added into main_grad, or copied for autograd, at once
                self.pool.release(out)
            return
        self.outputs.extend(outs)

    def _all_reduce_partials(self, unit: _Unit) -> None:
        """HSDP without the replicate all-reduce on earlier micro-steps: the float32 totals of
        the local shards are packed and all-reduced across replicas in pool buckets, which are
        the outputs until the next step."""
        dtype = _dtype(self.cfg.fully_shard.reduce_dtype, "float32")
        local = [slot.chunk_shape for r in unit.reduces for slot in r.layout.slots]
        specs = [ParamSpec(str(i), shape, unit.name) for i, shape in enumerate(local)]
        for group in _groups(specs, ITEMSIZE[dtype], self.cfg.gradpool.bucket_cap_mib * MIB,
                             self.cfg.fully_shard.comm_fusion):
            layout = ReduceScatterLayout.build([s.shape for s in group], 1, self.pool.align(dtype))
            bucket = self.pool.acquire(layout.total_numel, dtype)
            self._copy(layout, dtype, padding=True, source="float32")
            self.outputs.append(bucket)

    def _input(self, r: _Reduce) -> _Bucket:
        bucket = self.pool.acquire(r.layout.total_numel, self.geo.reduce_dtype)
        self._input_bytes += bucket.nbytes
        self._copy(r.layout, self.geo.reduce_dtype, padding=True)
        # inputs still leased (packed, not launched) plus inputs fenced on their collective
        self.counts.input_peak = max(self.counts.input_peak,
                                     self._input_bytes + self.pool.fenced_bytes)
        return bucket

    def _copy(self, layout: ReduceScatterLayout, dtype: str, padding: bool,
              source: Optional[str] = None) -> None:
        size = ITEMSIZE[dtype]
        self.counts.bytes_copied += layout.total_numel * size
        self.counts.bytes_read += layout.data_numel * ITEMSIZE[source or self.geo.compute_dtype]
        if padding:
            self.counts.padding_bytes += layout.padding_numel * size


# -- the plan ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanConfig:
    ranks: int
    nodes: int
    device: str
    comm_fusion: bool
    bucket_cap_mib: float
    micro_steps: int
    reshard_after_forward: bool


@dataclass(frozen=True)
class PlanMesh:
    replicate: int
    shard: int
    ranks: int


@dataclass(frozen=True)
class ParamPlan:
    total: int
    shard_elements: int
    shard_bytes: int                      # the local shards are float32
    shard_padding_elements_rank0: int
    shard_padding_elements_last: int
    main_grad_bytes: int
    shard_grad_bytes: int                 # plain mode: the shard gradients autograd owns
    optimizer_state_bytes: int
    optimizer: str
    compute_dtype: str
    reduce_dtype: str


@dataclass(frozen=True)
class PoolPlan:
    high_water_bytes: int
    buckets: int
    new_allocations_step1: int
    new_allocations_after_step1: int
    reduce_buckets_per_step: int
    output_bytes: int
    output_data_bytes: int
    input_peak_bytes: int
    largest_input_bytes: int
    max_buckets_in_flight: Optional[int]
    padding_bytes_per_step: int
    alignment_bytes: int
    stalls_per_step: int
    fences: str


@dataclass(frozen=True)
class UpstreamPlan:
    """Upstream's reduce path: a fresh input and output per reduce, every step."""

    transient_peak_bytes: int
    allocations_per_step: int
    bytes_allocated_per_step: int
    bytes_copied_per_step: int


@dataclass(frozen=True)
class MegatronPlan:
    """A Megatron-style persistent buffer of every gradient (no copy)."""

    buffer_bytes: int
    bytes_copied_per_step: int
    dtype: str


@dataclass(frozen=True)
class CopyPlan:
    bytes_copied_per_step: int
    bytes_read_per_step: int
    estimated_seconds: float
    hbm_gbps: float
    copy_efficiency: float
    estimate: bool


@dataclass(frozen=True)
class ContextPlan:
    """What a rank holds besides the reduce path."""

    largest_unit: str
    largest_unit_gathered_bytes: int
    largest_unit_grad_bytes: int
    all_gathered_bytes: int
    hccl_buffer_bytes: int
    hccl_communicators: int
    device_memory_bytes: Optional[int]
    state_and_pool_bytes: int
    with_one_unit_bytes: int
    gathered_at_once_bytes: int
    as_implemented_bytes: int


@dataclass
class MemoryPlan:
    """Per-rank bytes (every rank of the mesh holds the same padded sizes)."""

    config: PlanConfig
    mesh: PlanMesh
    params: ParamPlan
    pool: PoolPlan
    upstream: UpstreamPlan
    megatron: MegatronPlan
    copy: CopyPlan
    context: ContextPlan
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_memory(cfg: RunConfig, options: PlanOptions = PlanOptions(),
                specs: Optional[list] = None) -> MemoryPlan:
    """The memory plan of ``cfg`` (see the module docstring); pure Python, no device.
    ``specs`` (:class:`ParamSpec` with units ``"root"`` and ``"layers.<i>"``) plans another
    model than ``cfg.model`` (the memory benchmark's dense stack)."""
    if not isinstance(cfg, RunConfig):
        raise InvalidArgumentError(f"plan_memory needs a RunConfig, got {type(cfg).__name__}")
    geo = _geometry(cfg, specs)
    pool = _PoolReplay(cfg.gradpool.alignment_bytes, cfg.gradpool.max_buckets_in_flight)
    replay = _StepReplay(cfg, geo, pool)
    replay.run()                     # the first step: what it allocates is counted below
    allocations_first = pool.new_allocations
    steady = replay.run()
    reduce_size = ITEMSIZE[geo.reduce_dtype]
    reduces = [r for unit in geo.units for r in unit.reduces]
    slots = [slot for r in reduces for slot in r.layout.slots]
    specs = [s for unit in geo.units for s in unit.specs]
    total_params = sum(s.numel for s in specs)
    shard_numel = sum(slot.chunk_numel for slot in slots)
    valid = [sum(slot.valid_length(rank) * slot.chunk_numel // slot.chunk_size for slot in slots)
             for rank in (0, geo.shards - 1)]
    use_main_grad = cfg.fully_shard.apply_grad_on_fp32_main_grad
    optimizer = 2 * shard_numel * 4 if cfg.train.optimizer == "adam" else 0
    params = ParamPlan(
        total=total_params,
        shard_elements=shard_numel,
        shard_bytes=shard_numel * 4,                    # the local shards are float32
        shard_padding_elements_rank0=shard_numel - valid[0],
        shard_padding_elements_last=shard_numel - valid[1],
        main_grad_bytes=shard_numel * 4 if use_main_grad else 0,
        # without main_grad, value_and_grad returns copies of the reduced shards (pool memory
        # never leaves the pool), held until the optimizer step; main_grad mode returns shared
        # zeros
        shard_grad_bytes=0 if use_main_grad else shard_numel * 4,
        optimizer_state_bytes=optimizer,
        optimizer=cfg.train.optimizer,
        compute_dtype=geo.compute_dtype,
        reduce_dtype=geo.reduce_dtype,
    )
    inputs = [r.layout.total_numel * reduce_size for r in reduces]
    outputs = [round_up(r.layout.row_numel, pool.align(geo.reduce_dtype)) * reduce_size
               for r in reduces]
    pool_plan = PoolPlan(
        high_water_bytes=pool.high_water,
        buckets=len(pool.buckets),
        new_allocations_step1=allocations_first,
        new_allocations_after_step1=pool.new_allocations - allocations_first,
        reduce_buckets_per_step=len(reduces),
        output_bytes=steady.output_bytes,
        output_data_bytes=sum(outputs),
        input_peak_bytes=steady.input_peak,
        largest_input_bytes=max(inputs),
        max_buckets_in_flight=cfg.gradpool.max_buckets_in_flight,
        padding_bytes_per_step=steady.padding_bytes,
        alignment_bytes=cfg.gradpool.alignment_bytes,
        stalls_per_step=pool.stalls // 2,
        fences="until waited (Ascend)" if cfg.launch.device == "Ascend"
                  else "complete at launch (CPU)",
    )
    unit_sums = [sum(r.layout.total_numel * reduce_size
                     + round_up(r.layout.row_numel, pool.align(geo.reduce_dtype)) * reduce_size
                     for r in unit.reduces) for unit in geo.units]
    upstream = UpstreamPlan(
        transient_peak_bytes=max(unit_sums),
        allocations_per_step=2 * len(reduces) * (cfg.train.micro_steps if replay.partials
                                                     else 1),
        bytes_allocated_per_step=sum(inputs) + sum(outputs),
        bytes_copied_per_step=steady.bytes_copied,
    )
    main_grad_size = 4 if use_main_grad else reduce_size
    lcm = math.lcm(geo.shards, MEGATRON_BUCKET_ALIGN)
    buffer = sum(round_up(sum(round_up(s.numel, MEGATRON_PARAM_ALIGN) for s in unit.specs), lcm)
                 for unit in geo.units) * main_grad_size
    megatron = MegatronPlan(buffer_bytes=buffer, bytes_copied_per_step=0,
                            dtype="float32" if use_main_grad else geo.reduce_dtype)
    bandwidth = options.hbm_gbps * 1e9 * options.copy_efficiency
    moved = steady.bytes_copied + steady.bytes_read
    copy = CopyPlan(
        bytes_copied_per_step=steady.bytes_copied,
        bytes_read_per_step=steady.bytes_read,
        estimated_seconds=moved / bandwidth,
        hbm_gbps=options.hbm_gbps,
        copy_efficiency=options.copy_efficiency,
        estimate=True,
    )
    largest = max(geo.units, key=lambda u: sum(s.numel for s in u.specs))
    unit_numel = sum(s.numel for s in largest.specs)
    communicators = 1 if geo.replicas == 1 and geo.shards == cfg.launch.ranks else (
        1 + (geo.shards > 1) + (geo.replicas > 1))
    buffsize = cfg.launch.hccl_buffsize_mib or HCCL_DEFAULT_BUFFSIZE_MIB
    gathered = unit_numel * ITEMSIZE[geo.compute_dtype]
    hccl = communicators * 2 * buffsize * MIB if cfg.launch.device == "Ascend" else 0
    memory = options.device_memory_gib or DEVICE_MEMORY_GIB.get(cfg.launch.device)
    state_and_pool = params.shard_bytes + params.main_grad_bytes + params.shard_grad_bytes \
        + optimizer + pool.high_water + hccl
    at_once = _gathered_at_once(cfg, geo)
    context = ContextPlan(
        largest_unit=largest.name, largest_unit_gathered_bytes=gathered,
        largest_unit_grad_bytes=gathered,
        all_gathered_bytes=total_params * ITEMSIZE[geo.compute_dtype],
        hccl_buffer_bytes=hccl, hccl_communicators=communicators,
        device_memory_bytes=int(memory * GIB) if memory else None,
        state_and_pool_bytes=state_and_pool, with_one_unit_bytes=state_and_pool + 2 * gathered,
        gathered_at_once_bytes=at_once, as_implemented_bytes=state_and_pool + at_once + gathered)
    notes = _notes(cfg, pool_plan)
    return MemoryPlan(
        config=PlanConfig(ranks=cfg.launch.ranks, nodes=cfg.launch.nodes,
                          device=cfg.launch.device, comm_fusion=cfg.fully_shard.comm_fusion,
                          bucket_cap_mib=cfg.gradpool.bucket_cap_mib,
                          micro_steps=cfg.train.micro_steps,
                          reshard_after_forward=cfg.fully_shard.reshard_after_forward),
        mesh=PlanMesh(replicate=geo.replicas, shard=geo.shards, ranks=geo.replicas * geo.shards),
        params=params, pool=pool_plan, upstream=upstream, megatron=megatron, copy=copy,
        context=context, notes=notes)


def _gathered_at_once(cfg: RunConfig, geo: _Geometry) -> int:
    """Gathered parameters a rank holds at the step's peak, as fully_shard does it: with
    reshard_after_forward the root (which keeps its own) and two layers (the running one and the
    one prefetched); without it every unit, from its forward until its backward."""
    if geo.shards == 1:
        return 0             # nothing is gathered: the local shard is the whole parameter
    sizes = [sum(s.numel for s in unit.specs) * ITEMSIZE[geo.compute_dtype] for unit in geo.units]
    if not cfg.fully_shard.reshard_after_forward:
        return sum(sizes)
    return sizes[0] + sum(sorted(sizes[1:], reverse=True)[:2])


def _notes(cfg: RunConfig, pool_plan: dict) -> list:
    notes = []
    cap = cfg.gradpool.max_cached_bytes
    if cap is not None and pool_plan.high_water_bytes > cap:
        notes.append(f"the planned high-water exceeds gradpool.max_cached_mib = "
                     f"{cfg.gradpool.max_cached_mib:g}: acquire would wait for in-flight buckets, "
                     "evict idle ones or refuse; this plan does not model the cap")
    if pool_plan.new_allocations_after_step1:
        notes.append("the pool still allocates after step 1 in this replay: buckets grow until "
                     "the largest request of each role has been seen")
    return notes


# -- the table ---------------------------------------------------------------------------------
def human(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, size in (("TiB", 2 ** 40), ("GiB", GIB), ("MiB", MIB), ("KiB", 2 ** 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_plan(plan: MemoryPlan, source: str = "") -> str:
    p, pool, up, meg, copy, ctx = (plan.params, plan.pool, plan.upstream, plan.megatron,
                                   plan.copy, plan.context)
    mesh = plan.mesh
    lines = [f"gradpool plan{': ' + source if source else ''}",
             f"mesh: {mesh.replicate} x {mesh.shard} (replicate x shard) = {mesh.ranks} "
             f"ranks on {plan.config.nodes} node(s), {plan.config.device}; "
             f"compute {p.compute_dtype}, reduce {p.reduce_dtype}; every rank holds the "
             "same padded sizes",
             f"parameters: {p.total:,}"
             + (f" ({p.total / 1e9:.1f} B)" if p.total >= 1e8 else "") + "; per rank "
             f"{p.shard_elements:,} shard elements (padding: rank 0 "
             f"{p.shard_padding_elements_rank0:,}, last shard rank "
             f"{p.shard_padding_elements_last:,})", ""]
    rows = [
        ("parameter shards (float32)", p.shard_bytes, "persistent"),
        ("main_grad (float32)", p.main_grad_bytes, "persistent"),
        ("shard gradients returned (plain mode)", p.shard_grad_bytes,
         "autograd's copies of the reduced shards, until the optimizer step"),
        (f"optimizer state ({p.optimizer})", p.optimizer_state_bytes, "persistent"),
        ("pool: high-water (replay of 2 steps)", pool.high_water_bytes,
         f"{pool.buckets} buckets, reserved once; "
         f"{pool.new_allocations_after_step1} new after step 1"),
        ("  buckets holding reduced shards", pool.output_bytes,
         f"{pool.reduce_buckets_per_step} shards of {human(pool.output_data_bytes)} "
         f"{p.reduce_dtype}, " + (
             "given back once added into main_grad: none held after backward"
             if p.main_grad_bytes else
             "given back once copied into autograd's gradients")),
        ("  input buckets in flight, at most", pool.input_peak_bytes,
         f"bound {pool.max_buckets_in_flight}; largest input "
         f"{human(pool.largest_input_bytes)}; fences {pool.fences}"),
        ("  padding + alignment written per step", pool.padding_bytes_per_step,
         f"alignment {pool.alignment_bytes} B"),
        ("upstream per-step allocation: peak", up.transient_peak_bytes,
         f"{up.allocations_per_step} allocations, {human(up.bytes_allocated_per_step)} "
         "allocated per step"),
        ("Megatron-style full gradient buffer", meg.buffer_bytes,
         f"persistent, {meg.dtype}, no copy (replaces main_grad)"),
    ]
    width = max(len(r[0]) for r in rows)
    lines.append(f"{'per rank':<{width}}  {'bytes':>12}  notes")
    for name, value, note in rows:
        lines.append(f"{name:<{width}}  {human(value):>12}  {note}")
    lines += ["",
              f"copied by the pool per step: {human(copy.bytes_copied_per_step)} written, "
              f"{human(copy.bytes_read_per_step)} read; ESTIMATED copy time "
              f"{copy.estimated_seconds * 1e3:.1f} ms per step at {copy.hbm_gbps:g} GB/s x "
              f"{copy.copy_efficiency:g} (an estimate until a 910B run measures it; "
              "--hbm-gbps and --copy-efficiency set it)",
              f"context (not the reduce path): largest unit {ctx.largest_unit} gathered "
              f"{human(ctx.largest_unit_gathered_bytes)} + its full gradients "
              f"{human(ctx.largest_unit_grad_bytes)}; every unit gathered "
              f"{human(ctx.all_gathered_bytes)}"
              + (f"; HCCL buffers {human(ctx.hccl_buffer_bytes)} "
                 f"({ctx.hccl_communicators} communicator(s) x 2 x HCCL_BUFFSIZE)"
                 if ctx.hccl_buffer_bytes else ""),
              f"per rank without activations: state + pool {human(ctx.state_and_pool_bytes)}; "
              f"+ one unit gathered {human(ctx.with_one_unit_bytes)}; as implemented "
              f"({_as_implemented(plan)}) {human(ctx.as_implemented_bytes)}"
              + (f"; device {human(ctx.device_memory_bytes)}"
                 if ctx.device_memory_bytes else "")]
    memory = ctx.device_memory_bytes
    if memory:
        fits = ctx.as_implemented_bytes <= memory
        lines.append(f"fits a {human(memory)} card without activations: "
                     f"{'yes' if fits else 'NO'} ({ctx.as_implemented_bytes / memory:.0%} of it)")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _as_implemented(plan: MemoryPlan) -> str:
    if plan.config.reshard_after_forward:
        return ("reshard_after_forward: the root and at most two layers gathered at once, the "
                "running one and the one prefetched; lazy init materialises local shards only")
    return "reshard_after_forward off: every unit gathered from its forward to its backward"
