"""The plan's figures, as ``gradpool plan`` prints them and ``--json`` gives them, and
:func:`plan_memory`, which computes them (see :mod:`gradpool.app.plan`)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional

from gradpool.app.config import RunConfig
from gradpool.app.plan.activations import ActivationPlan, plan_activations
from gradpool.app.plan.comm import CommPlan, link, plan_comm, shard_groups, strided_groups
from gradpool.app.plan.geometry import _Geometry, _geometry
from gradpool.app.plan.options import (DEVICE_MEMORY_GIB, GIB, HCCL_DEFAULT_BUFFSIZE_MIB,
                                       ITEMSIZE, MEGATRON_BUCKET_ALIGN, MEGATRON_PARAM_ALIGN,
                                       MIB, PlanOptions)
from gradpool.app.plan.replay import _PoolReplay, _StepCounts, _StepReplay
from gradpool.errors import InvalidArgumentError
from gradpool.layout import round_up


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
    main_grad_bytes: int                  # once every unit's gradient landed
    main_grad_in_backward_bytes: int      # held while the largest unit's backward runs
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
    in_backward_bytes: int                # state, pool, gathered units and one unit's gradients
    after_landing_bytes: int              # state, pool and every main_grad, gathered released
    as_implemented_bytes: int             # the larger of the two


@dataclass(frozen=True)
class ExpertPlan:
    """Expert parallelism as the plan lays it out (``model.expert_parallel > 1``)."""

    expert_parallel: int
    experts_per_rank: int             # of each MoE layer
    edp_ranks: int                    # the ranks holding the same experts
    expert_elements: int              # the local experts' parameters, every layer, gathered
    expert_shard_elements: int        # their shards on this rank
    dense_shard_elements: int
    largest_expert_unit_gathered_bytes: int
    ep_link: str
    edp_link: str
    dispatcher: str
    layout: str = ("EP groups of E consecutive ranks; each layer's local experts one fully_shard "
                   "unit, 1-D over the EDP ranks (stride E), no replicate all-reduce under HSDP; "
                   "dense weights on the data-parallel mesh")


@dataclass(frozen=True)
class FitPlan:
    """Per rank: the state, the pool and the gathered units (``without_activations``), with
    every layer's activations, and with full recompute, against the card."""

    device_memory_bytes: Optional[int]
    without_activations_bytes: int
    with_activations_bytes: int
    with_recompute_bytes: int
    uses_recompute: bool              # the verdict counts the recompute figure
    fits: Optional[bool]              # None: no card to compare with
    short_by_bytes: int               # how much the verdict's figure exceeds the card (0: fits)
    verdict: str


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
    activations: Optional[ActivationPlan] = None
    comm: Optional[CommPlan] = None
    experts: Optional[ExpertPlan] = None
    fit: Optional[FitPlan] = None
    notes: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Replayed:
    """Two replayed steps of the pool: the first allocates, the second is the steady state."""
    pool: _PoolReplay
    allocations_first: int           # the pool's new allocations in the first step
    steady: _StepCounts              # the second step's counts
    partials: bool                   # HSDP partial sums: a reduce every micro-step


@dataclass(frozen=True)
class _BucketBytes:
    """Each reduce's input and output bucket bytes, in the geometry's order."""
    inputs: list
    outputs: list


def plan_memory(cfg: RunConfig, options: PlanOptions = PlanOptions(),
                specs: Optional[list] = None) -> MemoryPlan:
    """The memory plan of ``cfg`` (see the module docstring); pure Python, no device.
    ``specs`` (:class:`ParamSpec` with units ``"root"`` and ``"layers.<i>"``) plans another
    model than ``cfg.model`` (the memory benchmark's dense stack)."""
    if not isinstance(cfg, RunConfig):
        raise InvalidArgumentError(f"plan_memory needs a RunConfig, got {type(cfg).__name__}")
    geo = _geometry(cfg, specs)
    replayed = _replay_two_steps(cfg, geo)
    reduces = [r for unit in geo.units for r in unit.reduces]
    sizes = _bucket_bytes(geo, replayed.pool, reduces)
    params = _param_plan(cfg, geo, reduces)
    pool_plan = _pool_plan(cfg, replayed, len(reduces), sizes)
    context = _context_plan(cfg, geo, options, params, replayed.pool.high_water)
    dispatcher = options.dispatcher_for(cfg.model.moe_dispatcher, cfg.launch.device)
    activations = plan_activations(cfg, geo.compute_dtype, dispatcher)
    fit = _fit(context, activations, cfg.train.micro_steps)
    intra, inter = options.bandwidths(cfg.launch.device)
    comm = plan_comm(cfg, geo, intra, inter, dispatcher, fit.uses_recompute)
    experts = _experts(cfg, geo, dispatcher) if geo.expert_parallel > 1 else None
    return MemoryPlan(
        config=_plan_config(cfg),
        mesh=PlanMesh(replicate=geo.replicas, shard=geo.shards, ranks=geo.replicas * geo.shards),
        params=params, pool=pool_plan,
        upstream=_upstream_plan(cfg, geo, replayed, len(reduces), sizes),
        megatron=_megatron_plan(cfg, geo), copy=_copy_plan(options, replayed.steady),
        context=context, activations=activations, comm=comm, experts=experts, fit=fit,
        notes=_notes(cfg, pool_plan))


def _replay_two_steps(cfg: RunConfig, geo: _Geometry) -> _Replayed:
    pool = _PoolReplay(cfg.gradpool.alignment_bytes, cfg.gradpool.max_buckets_in_flight)
    replay = _StepReplay(cfg, geo, pool)
    replay.run()                     # the first step: what it allocates is counted apart
    allocations_first = pool.new_allocations
    steady = replay.run()
    return _Replayed(pool=pool, allocations_first=allocations_first, steady=steady,
                     partials=replay.partials)


def _bucket_bytes(geo: _Geometry, pool: _PoolReplay, reduces: list) -> _BucketBytes:
    reduce_size = ITEMSIZE[geo.reduce_dtype]
    return _BucketBytes(
        inputs=[r.layout.total_numel * reduce_size for r in reduces],
        outputs=[round_up(r.layout.row_numel, pool.align(geo.reduce_dtype)) * reduce_size
                 for r in reduces])


def _main_grad_in_backward(cfg: RunConfig, geo: _Geometry, main_grad_bytes: int) -> int:
    """What ``main_grad`` holds while the largest unit's backward runs. It is allocated when a
    unit's first reduced shard lands after ``zero_grad``: synchronous, in each unit's own
    backward, so every unit but the running one; asynchronous, when the unit after the next one
    launches its reduce, so every unit but the running one and the one before it (counted as
    large as the running one: the plan does not know the order); and in full when earlier
    micro-steps landed already (each micro-step reduced, no HSDP partial sums and no
    accumulation in the units' buckets)."""
    every_micro_step_lands = (cfg.train.micro_steps > 1
                              and not cfg.fully_shard.all_reduce_every_micro_step
                              and geo.replicas == 1)
    if every_micro_step_lands:
        return main_grad_bytes
    largest = max(geo.units, key=lambda u: u.numel)
    running = sum(slot.chunk_numel for r in largest.reduces for slot in r.layout.slots) * 4
    in_flight = running if cfg.gradpool.async_reduce else 0
    return max(0, main_grad_bytes - running - in_flight)


def _plan_config(cfg: RunConfig) -> PlanConfig:
    return PlanConfig(ranks=cfg.launch.ranks, nodes=cfg.launch.nodes,
                      device=cfg.launch.device, comm_fusion=cfg.fully_shard.comm_fusion,
                      bucket_cap_mib=cfg.gradpool.bucket_cap_mib,
                      micro_steps=cfg.train.micro_steps,
                      reshard_after_forward=cfg.fully_shard.reshard_after_forward)


def _param_plan(cfg: RunConfig, geo: _Geometry, reduces: list) -> ParamPlan:
    slots = [slot for r in reduces for slot in r.layout.slots]
    shard_numel = sum(slot.chunk_numel for slot in slots)
    valid = [sum(slot.valid_length(0 if first else unit.shards - 1) * slot.chunk_numel
                 // slot.chunk_size for unit in geo.units for r in unit.reduces
                 for slot in r.layout.slots) for first in (True, False)]
    use_main_grad = cfg.fully_shard.apply_grad_on_fp32_main_grad
    return ParamPlan(
        main_grad_in_backward_bytes=_main_grad_in_backward(cfg, geo, shard_numel * 4)
        if use_main_grad else 0,
        total=geo.model_numel,                          # every expert, not only this rank's
        shard_elements=shard_numel,
        shard_bytes=shard_numel * 4,                    # the local shards are float32
        shard_padding_elements_rank0=shard_numel - valid[0],
        shard_padding_elements_last=shard_numel - valid[1],
        main_grad_bytes=shard_numel * 4 if use_main_grad else 0,
        # without main_grad, value_and_grad returns copies of the reduced shards (pool memory
        # never leaves the pool), held until the optimizer step; main_grad mode returns shared
        # zeros
        shard_grad_bytes=0 if use_main_grad else shard_numel * 4,
        optimizer_state_bytes=2 * shard_numel * 4 if cfg.train.optimizer == "adam" else 0,
        optimizer=cfg.train.optimizer,
        compute_dtype=geo.compute_dtype,
        reduce_dtype=geo.reduce_dtype,
    )


def _pool_plan(cfg: RunConfig, replayed: _Replayed, reduce_buckets: int,
               sizes: _BucketBytes) -> PoolPlan:
    pool, steady = replayed.pool, replayed.steady
    return PoolPlan(
        high_water_bytes=pool.high_water,
        buckets=len(pool.buckets),
        new_allocations_step1=replayed.allocations_first,
        new_allocations_after_step1=pool.new_allocations - replayed.allocations_first,
        reduce_buckets_per_step=reduce_buckets,
        output_bytes=steady.output_bytes,
        output_data_bytes=sum(sizes.outputs),
        input_peak_bytes=steady.input_peak,
        largest_input_bytes=max(sizes.inputs),
        max_buckets_in_flight=cfg.gradpool.max_buckets_in_flight,
        padding_bytes_per_step=steady.padding_bytes,
        alignment_bytes=cfg.gradpool.alignment_bytes,
        stalls_per_step=pool.stalls // 2,
        fences="until waited (Ascend)" if cfg.launch.device == "Ascend"
                  else "complete at launch (CPU)",
    )


def _upstream_plan(cfg: RunConfig, geo: _Geometry, replayed: _Replayed, reduce_buckets: int,
                   sizes: _BucketBytes) -> UpstreamPlan:
    """Upstream's figures: each reduce allocates its input and output buckets afresh."""
    reduce_size = ITEMSIZE[geo.reduce_dtype]
    align = replayed.pool.align(geo.reduce_dtype)
    unit_sums = [sum(r.layout.total_numel * reduce_size
                     + round_up(r.layout.row_numel, align) * reduce_size
                     for r in unit.reduces) for unit in geo.units]
    return UpstreamPlan(
        transient_peak_bytes=max(unit_sums),
        allocations_per_step=2 * reduce_buckets * (cfg.train.micro_steps if replayed.partials
                                                   else 1),
        bytes_allocated_per_step=sum(sizes.inputs) + sum(sizes.outputs),
        bytes_copied_per_step=replayed.steady.bytes_copied,
    )


def _megatron_plan(cfg: RunConfig, geo: _Geometry) -> MegatronPlan:
    use_main_grad = cfg.fully_shard.apply_grad_on_fp32_main_grad
    main_grad_size = 4 if use_main_grad else ITEMSIZE[geo.reduce_dtype]
    buffer = sum(round_up(sum(round_up(s.numel, MEGATRON_PARAM_ALIGN) for s in unit.specs),
                          math.lcm(unit.shards, MEGATRON_BUCKET_ALIGN))
                 for unit in geo.units) * main_grad_size
    return MegatronPlan(buffer_bytes=buffer, bytes_copied_per_step=0,
                        dtype="float32" if use_main_grad else geo.reduce_dtype)


def _copy_plan(options: PlanOptions, steady: _StepCounts) -> CopyPlan:
    bandwidth = options.hbm_gbps * 1e9 * options.copy_efficiency
    moved = steady.bytes_copied + steady.bytes_read
    return CopyPlan(
        bytes_copied_per_step=steady.bytes_copied,
        bytes_read_per_step=steady.bytes_read,
        estimated_seconds=moved / bandwidth,
        hbm_gbps=options.hbm_gbps,
        copy_efficiency=options.copy_efficiency,
        estimate=True,
    )


def _communicators(cfg: RunConfig, geo: _Geometry) -> int:
    """The communicators a rank creates (each holds HCCL buffers on Ascend)."""
    communicators = 1 if geo.replicas == 1 and geo.shards == cfg.launch.ranks else (
        1 + (geo.shards > 1) + (geo.replicas > 1))
    if geo.expert_parallel > 1:      # the EP group's (dispatch) and the EDP group's
        communicators += 1 + (geo.expert_shards > 1)
    return communicators


def _context_plan(cfg: RunConfig, geo: _Geometry, options: PlanOptions, params: ParamPlan,
                  pool_high_water: int) -> ContextPlan:
    largest = max(geo.units, key=lambda u: u.numel)
    communicators = _communicators(cfg, geo)
    buffsize = cfg.launch.hccl_buffsize_mib or HCCL_DEFAULT_BUFFSIZE_MIB
    gathered = largest.numel * ITEMSIZE[geo.compute_dtype]
    hccl = communicators * 2 * buffsize * MIB if cfg.launch.device == "Ascend" else 0
    memory = options.device_memory_gib or DEVICE_MEMORY_GIB.get(cfg.launch.device)
    state_and_pool = params.shard_bytes + params.main_grad_bytes + params.shard_grad_bytes \
        + params.optimizer_state_bytes + pool_high_water + hccl
    at_once = _gathered_at_once(cfg, geo)
    # main_grad costs memory only once a gradient landed: in backward, only what landed already
    in_backward = (state_and_pool - params.main_grad_bytes + params.main_grad_in_backward_bytes
                   + at_once + gathered)
    return ContextPlan(
        largest_unit=largest.name, largest_unit_gathered_bytes=gathered,
        largest_unit_grad_bytes=gathered,
        all_gathered_bytes=sum(u.numel for u in geo.units) * ITEMSIZE[geo.compute_dtype],
        hccl_buffer_bytes=hccl, hccl_communicators=communicators,
        device_memory_bytes=int(memory * GIB) if memory else None,
        state_and_pool_bytes=state_and_pool, with_one_unit_bytes=state_and_pool + 2 * gathered,
        gathered_at_once_bytes=at_once, in_backward_bytes=in_backward,
        after_landing_bytes=state_and_pool,
        as_implemented_bytes=max(in_backward, state_and_pool))


def _fit(context: ContextPlan, activations: ActivationPlan, micro_steps: int) -> FitPlan:
    """The verdict: with every layer's activations if that fits, else with full recompute
    (the config has no recompute key: the plan says which the run needs); when even that does
    not fit, by how much and which parts are largest."""
    base = context.as_implemented_bytes
    plain, recompute = base + activations.plain_bytes, base + activations.recompute_bytes
    memory = context.device_memory_bytes
    if memory is None:
        return FitPlan(None, base, plain, recompute, False, None, 0,
                       "no card to compare with (--device-memory-gib sets one)")
    uses_recompute = plain > memory
    counted = recompute if uses_recompute else plain
    fits = counted <= memory
    if uses_recompute:
        verdict = (f"with full recompute, {counted / memory:.0%} of it (every layer's "
                   f"activations kept: {plain / memory:.0%})")
    else:
        verdict = f"every layer's activations kept, {counted / memory:.0%} of it (no recompute)"
    if not fits:
        gathered = context.gathered_at_once_bytes + context.largest_unit_grad_bytes
        parts = sorted([("gathered parameters and one unit's full gradients", gathered),
                        ("sharded state, pool and HCCL buffers", context.state_and_pool_bytes),
                        ("activations", counted - base)], key=lambda part: -part[1])
        verdict += (f"; {(counted - memory) / GIB:.2f} GiB over: "
                    + ", ".join(f"{name} {value / GIB:.2f} GiB" for name, value in parts))
    if micro_steps > 1:
        verdict += f"; activations of one micro-step of {micro_steps}"
    return FitPlan(memory, base, plain, recompute, uses_recompute, fits,
                   max(0, counted - memory), verdict)


def _experts(cfg: RunConfig, geo: _Geometry, dispatcher: str) -> ExpertPlan:
    ranks, ep = cfg.launch.ranks, geo.expert_parallel
    per_node = cfg.launch.local_ranks
    units = [u for u in geo.units if u.experts]
    shard = sum(slot.chunk_numel for u in units for r in u.reduces for slot in r.layout.slots)
    dense = sum(slot.chunk_numel for u in geo.units if not u.experts for r in u.reduces
                for slot in r.layout.slots)
    return ExpertPlan(
        expert_parallel=ep, experts_per_rank=cfg.model.num_experts // ep,
        edp_ranks=geo.expert_shards, expert_elements=sum(u.numel for u in units),
        expert_shard_elements=shard, dense_shard_elements=dense,
        largest_expert_unit_gathered_bytes=max(u.numel for u in units)
        * ITEMSIZE[geo.compute_dtype],
        ep_link=link(shard_groups(ranks, ep), per_node),
        edp_link=link(strided_groups(ranks, ep), per_node), dispatcher=dispatcher)


def _gathered_at_once(cfg: RunConfig, geo: _Geometry) -> int:
    """Gathered parameters a rank holds at the step's peak, as fully_shard does it: with
    reshard_after_forward the root (which keeps its own) and two layers (the running one and the
    one prefetched); without it every unit, from its forward until its backward."""
    sizes: dict = {}         # root, then each layer (its dense part and its experts)
    for unit in geo.units:
        if unit.shards > 1:  # else nothing is gathered: the local shard is the whole parameter
            sizes[unit.layer] = sizes.get(unit.layer, 0) + unit.numel * ITEMSIZE[geo.compute_dtype]
    if not cfg.fully_shard.reshard_after_forward:
        return sum(sizes.values())
    root = sizes.pop(None, 0)
    return root + sum(sorted(sizes.values(), reverse=True)[:2])


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


