"""The run's geometry: which ``fully_shard`` units a rank has, over which ranks each is sharded,
and the reduce buckets the reducer builds for them.

Dense units (``root``, ``layers.<i>``) are sharded over the data-parallel mesh's shard group
(every rank, or the last dim of ``fully_shard.mesh_shape``) and replicated over its first dim.
With ``model.expert_parallel = E > 1`` each layer's routed experts leave ``layers.<i>``: rank
``r`` is EP rank ``r % E`` of the group of E consecutive ranks and holds experts
``[(r % E) * n, (r % E + 1) * n)`` (``n = num_experts / E``) as their own unit
``layers.<i>.moe.experts``, sharded 1-D over the expert-data-parallel (EDP) ranks, the ``W / E``
ranks with the same ``r % E`` (stride E), with no replicate all-reduce even under HSDP. Every EP
rank holds experts of the same shapes, so the plan lays out EP rank 0's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from gradpool.app.config import RunConfig
from gradpool.app.model import ParamSpec, parameter_specs
from gradpool.app.plan.options import ITEMSIZE, MIB
from gradpool.layout import ReduceScatterLayout, fusion_groups
from hyper_parallel.platform.mindspore.fully_shard.order import TAG_NUMEL

_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.experts\.(\d+)\.")


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
    shards: int = 1              # ranks the unit is sharded over
    replicas: int = 1            # HSDP replicas its reduced shards are all-reduced over
    experts: bool = False        # a layer's local experts (sharded over the EDP ranks)

    @property
    def numel(self) -> int:
        return sum(s.numel for s in self.specs)

    @property
    def layer(self) -> Optional[int]:
        """The decoder layer the unit belongs to (its dense part or its experts); None: root."""
        return int(self.name.split(".")[1]) if self.name != "root" else None


@dataclass
class _Geometry:
    replicas: int                # the data-parallel mesh (dense units)
    shards: int
    compute_dtype: str           # gathered parameters and autograd's gradients
    reduce_dtype: str
    units: list                  # forward order: root, then each layer (dense, then experts)
    expert_parallel: int = 1
    expert_shards: int = 1       # the EDP ranks (W / E)
    model_numel: int = 0         # the model's parameters, every expert


def _dtype(name: Optional[str], default: str) -> str:
    return name if name is not None else default


def _groups(specs: list, nbytes_each: int, cap_bytes: float, fused: bool) -> list:
    """Parameters per bucket, by the reducer's own rule (:func:`gradpool.layout.fusion_groups`; one
    reduce dtype per call here)."""
    groups = fusion_groups([(None, s.numel * nbytes_each) for s in specs], cap_bytes, fused)
    return [[specs[i] for i in indices] for _, indices in groups]


def order_tail(cfg: RunConfig) -> int:
    """Elements a tagged bucket row reserves for the unit-order tag: the default check's tag
    (``check_unit_order: true``); strict mode agrees over the world instead, and no check carries
    nothing."""
    return TAG_NUMEL if cfg.gradpool.check_unit_order is True else 0


def _reduce_layouts(groups: list, shards: int, align: int, tail: int) -> tuple:
    """The reduce buckets of one unit's reduce call, as the reducer lays them out (its
    ``_plan``): ``tail`` (the order tag, 0 for none) reserved in every row of the smallest
    bucket, the first of equal ones; the others keep their layouts."""
    def build(group, tail_numel=0):
        return ReduceScatterLayout.build([s.shape for s in group], shards, align,
                                         tail_numel=tail_numel)
    layouts = [build(group) for group in groups]
    if tail and layouts:
        smallest = min(range(len(layouts)),
                       key=lambda k: (layouts[k].total_numel, layouts[k].data_numel))
        layouts[smallest] = build(groups[smallest], tail)
    return tuple(_Reduce(tuple(group), layout) for group, layout in zip(groups, layouts))


def _mesh(cfg: RunConfig) -> tuple[int, int]:
    shape = cfg.fully_shard.mesh_shape
    if shape is None:
        return 1, cfg.launch.ranks
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], shape[1]


def local_expert_specs(specs: list, expert_parallel: int, num_experts: int,
                       ep_rank: int = 0) -> list:
    """``specs`` as EP rank ``ep_rank`` holds them: the routed experts of other EP ranks left
    out, its own moved into unit ``layers.<i>.moe.experts`` (names stay global). With
    ``expert_parallel == 1`` the specs unchanged."""
    if expert_parallel == 1:
        return list(specs)
    per_rank = num_experts // expert_parallel
    mine = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
    out = []
    for spec in specs:
        match = _EXPERT.match(spec.name)
        if match is None:
            out.append(spec)
        elif int(match.group(2)) in mine:
            out.append(ParamSpec(spec.name, spec.shape, f"layers.{match.group(1)}.moe.experts"))
    return out


def _unit_order(name: str) -> tuple:
    if name == "root":
        return (-1, 0)
    return (int(name.split(".")[1]), name.endswith(".moe.experts"))


def _geometry(cfg: RunConfig, specs: Optional[list] = None) -> _Geometry:
    replicas, shards = _mesh(cfg)
    fs, pool = cfg.fully_shard, cfg.gradpool
    compute = _dtype(fs.param_dtype, "float32")       # the model's parameters are float32
    reduce = _dtype(fs.reduce_dtype, compute)
    align = max(1, pool.alignment_bytes // ITEMSIZE[reduce])
    align32 = max(1, pool.alignment_bytes // ITEMSIZE["float32"])
    ep = cfg.model.expert_parallel
    expert_shards = cfg.launch.ranks // ep
    tail = order_tail(cfg)
    if specs is None:
        specs = parameter_specs(cfg.model)
    by_unit: dict = {}
    for spec in local_expert_specs(specs, ep, cfg.model.num_experts):
        by_unit.setdefault(spec.unit, []).append(spec)
    units = []
    for name in sorted(by_unit, key=_unit_order):
        unit_specs = by_unit[name]
        experts = name.endswith(".moe.experts")
        unit_shards, unit_replicas = (expert_shards, 1) if experts else (shards, replicas)
        # a unit's reduce carries the order tag when it is a collective (sharded or replicated)
        reduces = _reduce_layouts(
            _groups(unit_specs, ITEMSIZE[reduce], pool.bucket_cap_mib * MIB, fs.comm_fusion),
            unit_shards, align, tail if unit_shards > 1 or unit_replicas > 1 else 0)
        gather = None
        if fs.comm_fusion and unit_shards > 1:
            # launch_all_gather: one send row of the local shards, one [W, row] receive bucket,
            # in the shards' own dtype (float32), at the same alignment as a reduce bucket; the
            # (one dtype's) bucket carries the order tag at the end of every row
            full = ReduceScatterLayout.build([s.shape for s in unit_specs], unit_shards, align32,
                                             tail_numel=tail)
            row = ReduceScatterLayout.build([slot.chunk_shape for slot in full.slots], 1,
                                            align32, tail_numel=tail)
            gather = (row.total_numel, full.total_numel)
        units.append(_Unit(name, tuple(unit_specs), reduces, gather, unit_shards, unit_replicas,
                           experts))
    return _Geometry(replicas, shards, compute, reduce, units, ep, expert_shards,
                     sum(s.numel for s in specs))
