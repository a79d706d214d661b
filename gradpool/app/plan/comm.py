"""Per rank, per step: what a rank sends over the network, over which link, and how long that
takes at given bandwidths.

Ranks are numbered node-major (rank ``r`` on node ``r // ranks_per_node``), the data-parallel
mesh ``[R, S]`` row-major (a shard group is S consecutive ranks, a replicate group ranks S
apart), an EP group E consecutive ranks, an EDP group the ranks E apart. A group is
*intra-node* when every group of its kind lies inside one node, else *inter-node*.

Bytes are the standard ring costs per rank: an all-gather or reduce-scatter of a full size F over
g ranks sends (and receives) ``(g - 1) / g * F``, an all-reduce ``2 (g - 1) / g * F``, an
all-to-all the part of its buffer bound for other ranks. The time of a row is its bytes over the
bandwidth of its link, and the step's the sum of the rows: it ignores overlap with compute (which
hides much of it) and hierarchical algorithms (which move inter-node traffic onto faster links),
so it is a bound from above of what the network alone costs, at published bandwidths.

What a step sends, by ``gradpool train``'s schedule: each micro-step's forward all-gathers every
unit (the root, each layer's dense part over the shard group, each layer's local experts over
their EDP group) and, with ``reshard_after_forward``, the backward gathers every layer again (the
root keeps its own); the reduce-scatter of each unit's gradients in ``reduce_dtype`` runs per
micro-step, or once when micro-steps accumulate into the buckets; HSDP all-reduces the reduced
shards over the replicas. Expert parallelism adds the token dispatch of every MoE layer, per
micro-step: all-to-all: the ``N * k`` token rows sent to their experts' ranks and the outputs
sent back (two all-to-alls forward, two backward), ``(E - 1) / E`` of them leaving the rank;
all-gather: the EP group's tokens ``[E * N, H]`` gathered with their routing weights ``[E * N,
num_experts]`` as extra columns (one all-gather), the outputs combined by a
reduce-scatter, and in backward the output gradients gathered and the input gradients
reduce-scattered. Full recompute runs each layer's forward dispatch again in its backward.

The unit-order check (``gradpool.check_unit_order``, on by default) adds no row: each unit's
all-gather and reduce carry its tag in a few elements at the end of every rank's row (48 per
row of one bucket per unit collective, counted in the rows' bytes and, by the geometry, in the
pool's buckets), and the host reads one flag per step. Its ``strict``
mode would add a small all-reduce over the world before every unit collective (a note says so).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gradpool.app.config import RunConfig
from gradpool.app.plan.geometry import _dtype, _Geometry, order_tail
from gradpool.app.plan.options import ITEMSIZE
from hyper_parallel.platform.mindspore.fully_shard.order import TAG_NUMEL

INTRA, INTER = "intra-node", "inter-node"


def link(groups, ranks_per_node: int) -> str:
    """INTRA if every group (an iterable of ranks) lies in one node, else INTER."""
    for group in groups:
        if len({rank // ranks_per_node for rank in group}) > 1:
            return INTER
    return INTRA


def shard_groups(ranks: int, size: int) -> list:
    """Consecutive groups of ``size`` ranks: the shard groups of the mesh, or the EP groups."""
    return [range(start, start + size) for start in range(0, ranks, size)]


def strided_groups(ranks: int, stride: int) -> list:
    """Ranks ``stride`` apart: the replicate groups of the mesh, or the EDP groups."""
    return [range(start, ranks, stride) for start in range(stride)]


@dataclass(frozen=True)
class CommRow:
    what: str
    collective: str              # all-gather | reduce-scatter | all-reduce | all-to-all | ...
    group: str                   # which ranks
    group_size: int
    link: str
    collectives: int             # launched per step
    full_bytes: int              # the sizes before the ring factor
    bytes: int                   # per rank per step, sent (as much is received)
    seconds: Optional[float]     # at the link's bandwidth; None without one
    off_node: float = 0.0        # the share of ``bytes`` that leaves the node


@dataclass(frozen=True)
class CommPlan:
    rows: list
    intra_node_gbps: Optional[float]
    inter_node_gbps: Optional[float]
    ranks_per_node: int
    dispatcher: Optional[str]     # None: no expert parallelism
    recompute: bool               # the dispatch rows include recompute's
    total_bytes: int
    estimated_seconds: Optional[float]
    estimate: bool = True
    ignores: str = ("overlap with compute and hierarchical (intra-node first) algorithms; ring "
                    "costs at the given bandwidths")
    notes: list = field(default_factory=list)


class _Rows:
    def __init__(self, bandwidth: dict):
        self.rows: list = []
        self.bandwidth = bandwidth

    def add(self, what: str, collective: str, group: str, size: int, where: str, count: int,
            full: float, factor: float, off_node: float = 1.0) -> None:
        """``off_node``: the share of an inter-node row's bytes that leaves the node; the rest
        goes to peers in the node over their own link at the same time (all-to-all only: a
        ring moves at the pace of its slowest hop)."""
        if size <= 1 or count == 0 or full == 0:
            return                           # nothing leaves the rank
        sent = int(round(full * factor))
        seconds = None
        if where == INTRA and self.bandwidth[INTRA]:
            seconds = sent / (self.bandwidth[INTRA] * 1e9)
        elif where == INTER and self.bandwidth[INTER] and (off_node == 1 or self.bandwidth[INTRA]):
            seconds = sent * off_node / (self.bandwidth[INTER] * 1e9)
            if off_node < 1:
                seconds = max(seconds, sent * (1 - off_node) / (self.bandwidth[INTRA] * 1e9))
        self.rows.append(CommRow(what, collective, group, size, where, count, int(full), sent,
                                 seconds, off_node if where == INTER else 0.0))


def plan_comm(cfg: RunConfig, geo: _Geometry, intra_gbps: Optional[float],
              inter_gbps: Optional[float], dispatcher: str, recompute: bool) -> CommPlan:
    ranks, micro = cfg.launch.ranks, cfg.train.micro_steps
    per_node = cfg.launch.local_ranks
    fs = cfg.fully_shard
    compute, reduce = ITEMSIZE[geo.compute_dtype], ITEMSIZE[geo.reduce_dtype]
    accumulate = micro > 1 and fs.all_reduce_every_micro_step
    partials = micro > 1 and geo.replicas > 1 and not fs.all_reduce_every_micro_step
    reduces = 1 if accumulate else micro
    rows = _Rows({INTRA: intra_gbps, INTER: inter_gbps})
    ep = geo.expert_parallel
    kinds = [("dense units", [u for u in geo.units if not u.experts], geo.shards,
              f"shard group ({geo.shards} consecutive ranks)",
              link(shard_groups(ranks, geo.shards), per_node))]
    if ep > 1:
        kinds.append(("local experts", [u for u in geo.units if u.experts], geo.expert_shards,
                      f"EDP group ({geo.expert_shards} ranks, {ep} apart)",
                      link(strided_groups(ranks, ep), per_node)))
    for label, units, size, group, where in kinds:
        # gathered: each parameter padded to a multiple of the group on dim 0, plus the order
        # tag one gather of each unit carries in every rank's row; reduced: the buckets as the
        # reducer lays them out (alignment gaps and the tag included)
        tag = order_tail(cfg) * size
        padded = [sum(slot.chunk_numel * size for r in u.reduces for slot in r.layout.slots)
                  + tag for u in units]
        every = sum(padded)
        layers = sum(n for u, n in zip(units, padded) if u.name != "root")
        buckets = sum(r.layout.total_numel for u in units for r in u.reduces)
        factor = (size - 1) / size
        # one fused all-gather per unit, else one per parameter
        gathers = [1 if fs.comm_fusion else len(u.specs) for u in units]
        rows.add(f"{label}: all-gather, forward", "all-gather", group, size, where,
                 micro * sum(gathers), micro * every * compute, factor)
        if fs.reshard_after_forward:
            rows.add(f"{label}: all-gather again in backward", "all-gather", group, size, where,
                     micro * sum(n for u, n in zip(units, gathers) if u.name != "root"),
                     micro * layers * compute, factor)
        rows.add(f"{label}: reduce-scatter of the gradients ({geo.reduce_dtype})",
                 "reduce-scatter", group, size, where,
                 reduces * sum(len(u.reduces) for u in units), reduces * buckets * reduce,
                 factor)
    if geo.replicas > 1:
        dense = [u for u in geo.units if not u.experts]
        rows_numel = sum(r.layout.row_numel for u in dense for r in u.reduces)
        dtype = _dtype(fs.reduce_dtype, "float32") if partials else geo.reduce_dtype
        count = 1 if (accumulate or partials) else micro
        rows.add("dense units: all-reduce over the replicas (HSDP)", "all-reduce",
                 f"replicate group ({geo.replicas} ranks, {geo.shards} apart)", geo.replicas,
                 link(strided_groups(ranks, geo.shards), per_node),
                 count * sum(len(u.reduces) for u in dense),
                 count * rows_numel * ITEMSIZE[dtype], 2 * (geo.replicas - 1) / geo.replicas)
    if ep > 1:
        _dispatch(cfg, rows, compute, dispatcher, recompute,
                  link(shard_groups(ranks, ep), per_node))
    total = sum(r.bytes for r in rows.rows)
    known = all(r.seconds is not None for r in rows.rows)
    unit_collectives = sum(r.collectives for r in rows.rows
                           if r.what.startswith(("dense", "local")) and r.collective != "all-reduce")
    notes = [_unit_order_note(cfg.gradpool.check_unit_order, unit_collectives)]
    return CommPlan(
        rows=rows.rows, intra_node_gbps=intra_gbps, inter_node_gbps=inter_gbps,
        ranks_per_node=per_node, dispatcher=dispatcher if ep > 1 else None,
        recompute=recompute and ep > 1, total_bytes=total,
        estimated_seconds=sum(r.seconds for r in rows.rows) if known else None,
        notes=[n for n in notes if n])


def _unit_order_note(mode, unit_collectives: int) -> str:
    """What the unit-order check costs, in words (it adds no row: see the module's doc)."""
    if mode == "strict":
        return (f"check_unit_order: strict adds a small all-reduce over the world, read on the "
                f"host, before each of the {unit_collectives:,} unit collectives (not in the rows)")
    if mode:
        return ("check_unit_order: no collective of its own; each unit collective carries its "
                f"tag in {TAG_NUMEL} elements per rank row, and the host reads one flag per step")
    return ""


def _dispatch(cfg: RunConfig, rows: _Rows, compute: int, dispatcher: str, recompute: bool,
              where: str) -> None:
    """The token dispatch of every MoE layer, per micro-step (see the module docstring)."""
    m, micro = cfg.model, cfg.train.micro_steps
    ep, tokens, hidden = m.expert_parallel, m.batch_size * m.seq_len, m.hidden_size
    times = micro * m.num_layers
    group = f"EP group ({ep} consecutive ranks)"
    phases = ["forward", "backward"] + (["recompute"] if recompute else [])
    if dispatcher == "all-to-all":
        pairs = tokens * m.experts_per_token
        # EP groups are consecutive ranks: a group spanning nodes spans whole nodes, so of the
        # E - 1 peers a row goes to, E - ranks_per_node are on other nodes
        per_node = min(cfg.launch.local_ranks, ep)
        for phase in phases:
            rows.add(f"token dispatch + combine, {phase} (all-to-all)", "all-to-all", group, ep,
                     where, 2 * times, 2 * times * pairs * hidden * compute, (ep - 1) / ep,
                     off_node=(ep - per_node) / (ep - 1))
        return
    factor = (ep - 1) / ep
    gathered = ep * tokens
    for phase in phases:
        # the dispatcher gathers each token's routing weights over every expert with the token,
        # as extra columns of one tensor: one all-gather (CPU collectives cost milliseconds)
        routing = gathered * m.num_experts * compute if phase != "backward" else 0
        rows.add(f"tokens{' and routing' if routing else ''} all-gathered, {phase}"
                 + (" (output gradients)" if phase == "backward" else ""), "all-gather", group,
                 ep, where, times, times * (gathered * hidden * compute + routing), factor)
        rows.add(f"outputs reduce-scattered, {phase}"
                 + (" (input gradients)" if phase == "backward" else " (combine)"),
                 "reduce-scatter", group, ep, where, times, times * gathered * hidden * compute,
                 factor)
