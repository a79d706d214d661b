"""The plan as a table: ``gradpool plan`` prints :func:`format_plan` of a
:class:`~gradpool.app.plan.memory.MemoryPlan`."""
from __future__ import annotations

from typing import Optional

from gradpool.app.plan.memory import MemoryPlan
from gradpool.app.plan.options import GIB, MIB


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
             f"{p.shard_padding_elements_last:,})"]
    lines += _experts(plan) + [""]
    rows = [
        ("parameter shards (float32)", p.shard_bytes, "persistent"),
        ("main_grad (float32)", p.main_grad_bytes,
         f"allocated when its first reduced shard lands, dropped at zero_grad; "
         f"{human(p.main_grad_in_backward_bytes)} held in the largest unit's backward"
         if p.main_grad_bytes else "none (plain mode)"),
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
              f"({_as_implemented(plan)}) {human(ctx.as_implemented_bytes)}, the larger of "
              f"the largest unit's backward {human(ctx.in_backward_bytes)} and every main_grad "
              f"landed {human(ctx.after_landing_bytes)}"
              + (f"; device {human(ctx.device_memory_bytes)}"
                 if ctx.device_memory_bytes else "")]
    memory = ctx.device_memory_bytes
    if memory:
        fits = ctx.as_implemented_bytes <= memory
        lines.append(f"fits a {human(memory)} card without activations: "
                     f"{'yes' if fits else 'NO'} ({ctx.as_implemented_bytes / memory:.0%} of it)")
    lines += _comm(plan) + _activations(plan)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def _experts(plan: MemoryPlan) -> list:
    ex = plan.experts
    if ex is None:
        return []
    return [f"expert parallelism: {ex.expert_parallel} EP ranks ({ex.ep_link}), "
            f"{ex.experts_per_rank} experts per MoE layer per rank, sharded over {ex.edp_ranks} "
            f"EDP ranks ({ex.edp_link}): {ex.expert_elements:,} local expert elements per rank "
            f"gathered, {ex.expert_shard_elements:,} of them in its shards (dense shards "
            f"{ex.dense_shard_elements:,}); an expert unit gathered "
            f"{human(ex.largest_expert_unit_gathered_bytes)}; {ex.dispatcher} token dispatcher",
            f"layout assumed: {ex.layout}"]


def _seconds(value: Optional[float]) -> str:
    if value is None:
        return "-"
    return f"{value * 1e3:.1f} ms" if value >= 1e-4 else f"{value * 1e6:.2f} us"


def _comm(plan: MemoryPlan) -> list:
    comm = plan.comm
    if comm is None:
        return []
    if comm.intra_node_gbps is None or comm.inter_node_gbps is None:
        rates = ("no time estimate: no published bandwidth for this device "
                 "(--intra-node-gbps and --inter-node-gbps give one)")
    else:
        rates = (f"ESTIMATED at {comm.intra_node_gbps:g} GB/s intra-node, "
                 f"{comm.inter_node_gbps:g} GB/s inter-node per card "
                 "(--intra-node-gbps, --inter-node-gbps)")
    lines = ["", f"communication per rank per step ({comm.ranks_per_node} ranks per node; {rates}; "
             f"ring costs, ignores {comm.ignores.split(';')[0]}):"]
    if not comm.rows:
        return lines + ["  nothing leaves the rank"]
    width = max(len(r.what) for r in comm.rows)
    group = max(len(r.group) for r in comm.rows)
    for r in comm.rows:
        lines.append(f"  {r.what:<{width}}  {r.group:<{group}}  {r.link:<10}  "
                     f"{r.collectives:>7,} x  {human(r.bytes):>10}  {_seconds(r.seconds):>11}")
    total = _seconds(comm.estimated_seconds)
    lines.append(f"  {'total':<{width}}  {'':<{group}}  {'':<10}  {'':>9}  "
                 f"{human(comm.total_bytes):>10}  {total:>11}"
                 + (f"  (copy-in beside it: {plan.copy.estimated_seconds * 1e3:.1f} ms)"))
    return lines + [f"  note: {note}" for note in comm.notes]


def _activations(plan: MemoryPlan) -> list:
    act, fit = plan.activations, plan.fit
    if act is None or fit is None:
        return []
    lines = ["", f"activations per rank, one micro-step of {act.tokens:,} tokens ({act.dtype}; "
             f"{act.attention}; experts: {act.dispatcher}, {act.routed_pairs:,} token-expert "
             "pairs per layer):",
             f"  per layer {human(act.per_layer_bytes)} (attention {human(act.attention_bytes)}, "
             f"of it scores {human(act.scores_bytes)}; norms {human(act.norms_bytes)}; router and "
             f"experts {human(act.moe_bytes)}; dispatch buffers {human(act.dispatch_bytes)}); "
             f"one layer at a time {human(act.transient_bytes)}; final norm and loss "
             f"{human(act.root_bytes)}",
             f"  every layer kept: {human(act.plain_bytes)}; full recompute (each layer's input "
             f"{human(act.layer_input_bytes)} kept, one layer recomputed): "
             f"{human(act.recompute_bytes)}",
             f"per rank with activations: {human(fit.with_activations_bytes)}; with full "
             f"recompute {human(fit.with_recompute_bytes)}"
             + (f"; device {human(fit.device_memory_bytes)}" if fit.device_memory_bytes else "")]
    if fit.device_memory_bytes:
        lines.append(f"fits a {human(fit.device_memory_bytes)} card with activations: "
                     f"{'yes' if fit.fits else 'NO'}, {fit.verdict}")
    return lines


def _as_implemented(plan: MemoryPlan) -> str:
    if plan.config.reshard_after_forward:
        return ("reshard_after_forward: the root and at most two layers gathered at once, the "
                "running one and the one prefetched; lazy init materialises local shards only")
    return "reshard_after_forward off: every unit gathered from its forward to its backward"
