"""`gradpool plan` with expert parallelism, its communication table and its activation estimate:
figures against hand counts on small configs (pure logic, no MindSpore, no device), the link
classification, properties over sizes, and the 671B EP config that fits."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import assume, given, settings, strategies as st

from gradpool.app.cli import EXIT_OK, EXIT_USAGE, main
from gradpool.app.config import from_dict, load_config
from gradpool.app.model import parameter_specs
from gradpool.app.plan import (INTER, INTRA, PlanOptions, format_plan, link, local_expert_specs,
                               plan_memory)
from gradpool.app.plan.comm import shard_groups, strided_groups

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "deepseek3_tiny.yaml"
BIG = ROOT / "configs" / "deepseek3_671b_910b.yaml"
BIG_EP = ROOT / "configs" / "deepseek3_671b_910b_ep.yaml"
GIB = 2 ** 30


def _tiny(*overrides):
    # the tiny model's shapes: vocab 67, hidden 32, 2 layers, 4 heads, 4 experts of width 24,
    # top-2, 4 sequences of 8 tokens; float32 everywhere
    return load_config(TINY, ["launch.ranks=4", "model.expert_parallel=2", *overrides])


def _rows(plan) -> dict:
    return {row.what: row for row in plan.comm.rows}


def _chunk(dim0: int, group: int) -> int:
    return -(-dim0 // group)


def test_ep_figures_equal_a_hand_count_on_4_ranks_ep_2():
    """4 ranks, 1-D mesh (shard 4), E = 2: each rank holds 2 of the 4 experts of each layer,
    sharded over its 2 EDP ranks; dense weights over all 4."""
    plan = plan_memory(_tiny())
    ex = plan.experts
    hidden, inner, vocab = 32, 24, 67
    expert = 2 * hidden * inner + inner * hidden                 # gate, up, down
    assert (ex.expert_parallel, ex.experts_per_rank, ex.edp_ranks) == (2, 2, 2)
    assert ex.expert_elements == 2 * 2 * expert                  # 2 layers x 2 local experts
    assert ex.expert_shard_elements == 2 * 2 * expert // 2       # every dim 0 splits in 2
    layer_shard = 8 + 4 * 8 * hidden + 8 + 8 * 4                 # norms, q k v o, router rows / 4
    root_shard = 2 * _chunk(vocab, 4) * hidden + 8               # embed, head (17 rows), norm
    assert ex.dense_shard_elements == root_shard + 2 * layer_shard
    assert plan.params.shard_elements == ex.dense_shard_elements + ex.expert_shard_elements
    # the model's total counts every expert, not only the rank's
    assert plan.params.total == sum(s.numel for s in parameter_specs(_tiny().model))
    assert ex.largest_expert_unit_gathered_bytes == 2 * expert * 4

    rows = _rows(plan)
    # the unit-order check: one gather and one reduce bucket per unit collective carry 48
    # elements at the end of every rank's row
    tag = 48
    dense_layer = 2 * hidden + 4 * hidden * hidden + hidden * 4  # every dim 0 divisible by 4
    root = 2 * 4 * _chunk(vocab, 4) * hidden + hidden            # padded to 68 rows
    assert rows["dense units: all-gather, forward"].bytes == \
        3 / 4 * (root + 2 * dense_layer + 3 * 4 * tag) * 4
    assert rows["dense units: all-gather again in backward"].bytes == \
        3 / 4 * 2 * (dense_layer + 4 * tag) * 4
    assert rows["local experts: all-gather, forward"].bytes == \
        1 / 2 * 2 * (2 * expert + 2 * tag) * 4
    assert rows["local experts: all-gather again in backward"].bytes == \
        1 / 2 * 2 * (2 * expert + 2 * tag) * 4
    # reduce-scatter: float32 buckets, each rank's row rounded up to 512 bytes (128 elements);
    # the tag goes to each unit's smallest bucket (the first of equal ones): a norm's 8-element
    # row, where it fits the rounding, and an expert unit's first gate row (384 + 48: 512)
    up = lambda n: -(-n // 128) * 128                            # noqa: E731
    layer_rows = 2 * up(8) + 4 * up(8 * hidden) + up(8 * 4)
    assert up(8 + tag) == up(8)
    root_rows = 2 * up(_chunk(vocab, 4) * hidden) + up(8)
    assert rows["dense units: reduce-scatter of the gradients (float32)"].bytes == \
        3 / 4 * 4 * (root_rows + 2 * layer_rows) * 4
    expert_rows = 2 * (2 * (2 * up(16 * inner) + up(12 * hidden))
                       + up(16 * inner + tag) - up(16 * inner))
    assert rows["local experts: reduce-scatter of the gradients (float32)"].bytes == \
        1 / 2 * 2 * expert_rows * 4
    # the pool reduces one bucket per gradient the rank holds: root 3, each layer 7 dense and
    # 2 local experts x 3; their reduced rows are what the buckets hand back
    assert plan.pool.reduce_buckets_per_step == 3 + 2 * (7 + 2 * 3)
    assert plan.pool.output_data_bytes == (root_rows + 2 * layer_rows + expert_rows) * 4
    # the replay packs every bucket once a step: dense inputs of 4 rows, expert inputs of 2
    assert plan.copy.bytes_copied_per_step == (4 * (root_rows + 2 * layer_rows)
                                               + 2 * expert_rows) * 4
    # the all-gather dispatcher (CPU's default): per layer, the EP group's 2 x 32 tokens with
    # their routing weights over the 4 experts as extra float32 columns, in one all-gather; the
    # outputs reduce-scattered; backward gathers the output gradients and reduce-scatters the
    # input gradients: one collective of each kind per layer and phase
    tokens = 4 * 8
    assert ex.dispatcher == "all-gather"
    gathered = 2 * tokens * hidden * 4
    routing = 2 * tokens * 4 * 4
    assert rows["tokens and routing all-gathered, forward"].bytes == 2 * (gathered + routing) / 2
    assert [rows[name].collectives for name in (
        "tokens and routing all-gathered, forward", "outputs reduce-scattered, forward (combine)",
        "tokens all-gathered, backward (output gradients)",
        "outputs reduce-scattered, backward (input gradients)")] == [2, 2, 2, 2]
    assert rows["outputs reduce-scattered, forward (combine)"].bytes == 2 * gathered / 2
    assert rows["tokens all-gathered, backward (output gradients)"].bytes == 2 * gathered / 2
    assert rows["outputs reduce-scattered, backward (input gradients)"].bytes == 2 * gathered / 2
    assert "all-reduce" not in {r.collective for r in plan.comm.rows}      # no replicas
    assert plan.comm.total_bytes == sum(r.bytes for r in plan.comm.rows)

    a2a = _rows(plan_memory(_tiny(), PlanOptions(dispatcher="all-to-all")))
    # each of the 32 tokens sent to its 2 experts' ranks and back, half of it to the other rank
    assert a2a["token dispatch + combine, forward (all-to-all)"].bytes == \
        2 * 2 * tokens * 2 * hidden * 4 / 2


def test_the_gathered_units_at_the_peak_are_the_root_and_two_whole_layers():
    plan = plan_memory(_tiny())
    hidden, inner, vocab = 32, 24, 67
    layer = 2 * hidden + 4 * hidden * hidden + hidden * 4 + 2 * (3 * hidden * inner)
    root = 2 * vocab * hidden + hidden
    assert plan.context.gathered_at_once_bytes == (root + 2 * layer) * 4


def test_each_ep_rank_holds_its_own_experts_and_together_all():
    specs = parameter_specs(load_config(TINY).model)
    held = [local_expert_specs(specs, 2, 4, ep_rank) for ep_rank in (0, 1)]
    experts = [{s.name for s in h if ".moe.experts." in s.name} for h in held]
    assert {n.split(".")[4] for n in experts[0]} == {"0", "1"}
    assert {n.split(".")[4] for n in experts[1]} == {"2", "3"}
    assert experts[0] | experts[1] == {s.name for s in specs if ".moe.experts." in s.name}
    assert {s.unit for s in held[1] if ".moe.experts." in s.name} == \
        {"layers.0.moe.experts", "layers.1.moe.experts"}
    dense = [s for s in held[0] if ".moe.experts." not in s.name]
    assert dense == [s for s in specs if ".moe.experts." not in s.name]   # units unchanged
    assert local_expert_specs(specs, 1, 4) == specs


def test_hsdp_expert_units_are_one_d_over_the_edp_ranks():
    """HSDP [2, 4] with E = 2 on 8 ranks: dense reduced shards are all-reduced over the 2
    replicas; the experts (4 EDP ranks, 2 apart) are not."""
    cfg = load_config(TINY, ["launch.ranks=8", "model.expert_parallel=2",
                             "fully_shard.mesh_shape=[2,4]"])
    plan = plan_memory(cfg)
    rows = _rows(plan)
    assert plan.experts.edp_ranks == 4
    assert [r.what for r in plan.comm.rows if r.collective == "all-reduce"] == \
        ["dense units: all-reduce over the replicas (HSDP)"]
    assert rows["local experts: all-gather, forward"].group_size == 4
    assert rows["dense units: all-gather, forward"].group_size == 4
    dense_rows = sum(-(-_chunk(d0, 4) * rest // 128) * 128 for d0, rest in
                     [(67, 32), (67, 32), (32, 1)] + 2 * [(32, 1), (32, 32), (32, 32),
                                                          (32, 32), (32, 32), (32, 1), (32, 4)])
    assert rows["dense units: all-reduce over the replicas (HSDP)"].bytes == \
        2 * (2 - 1) / 2 * dense_rows * 4
    # two micro-steps, the replicate all-reduce on the last only: every unit reduce-scatters
    # each micro-step, the dense partial sums are all-reduced once; the experts have none
    micro = plan_memory(load_config(TINY, [
        "launch.ranks=8", "model.expert_parallel=2", "fully_shard.mesh_shape=[2,4]",
        "train.micro_steps=2", "fully_shard.all_reduce_every_micro_step=false"]))
    twice = _rows(micro)
    for what in ("dense units: reduce-scatter of the gradients (float32)",
                 "local experts: reduce-scatter of the gradients (float32)"):
        assert twice[what].bytes == 2 * rows[what].bytes
    assert twice["dense units: all-reduce over the replicas (HSDP)"].bytes == \
        rows["dense units: all-reduce over the replicas (HSDP)"].bytes
    assert micro.pool.new_allocations_after_step1 == 0


def test_links_intra_node_when_every_group_lies_in_one_node():
    assert link(shard_groups(8, 4), 4) == INTRA
    assert link(shard_groups(8, 4), 2) == INTER
    assert link(shard_groups(12, 4), 6) == INTER             # 4..7 straddles nodes 0 and 1
    assert link(strided_groups(8, 4), 8) == INTRA
    assert link(strided_groups(8, 4), 4) == INTER            # 0 and 4 on two nodes
    cfg = _tiny("launch.nodes=2", "launch.master_addr=127.0.0.1",
                "launch.master_port=8123")                   # 2 ranks per node
    plan = plan_memory(cfg, PlanOptions(intra_node_gbps=100, inter_node_gbps=10))
    assert plan.experts.ep_link == INTRA and plan.experts.edp_link == INTER
    rows = _rows(plan)
    assert rows["tokens all-gathered, backward (output gradients)"].link == INTRA
    assert rows["local experts: all-gather, forward"].link == INTER
    assert rows["dense units: all-gather, forward"].link == INTER
    for row in plan.comm.rows:
        gbps = 100 if row.link == INTRA else 10
        assert math.isclose(row.seconds, row.bytes / (gbps * 1e9))
    assert math.isclose(plan.comm.estimated_seconds, sum(r.seconds for r in plan.comm.rows))
    one_node = plan_memory(_tiny(), PlanOptions(intra_node_gbps=100, inter_node_gbps=10))
    assert {r.link for r in one_node.comm.rows} == {INTRA}


def test_cpu_has_no_time_estimate_without_bandwidths_ascend_has_the_published_ones():
    cpu = plan_memory(_tiny())
    assert cpu.comm.estimated_seconds is None and all(r.seconds is None for r in cpu.comm.rows)
    assert "no time estimate" in format_plan(cpu)
    big = plan_memory(load_config(BIG_EP))
    assert (big.comm.intra_node_gbps, big.comm.inter_node_gbps) == (392.0, 25.0)
    assert big.experts.dispatcher == "all-to-all"


def test_activations_equal_a_hand_count_of_the_tiny_model():
    """E = 1: the model computes every expert on every token (module docstring of
    gradpool.app.model); the tensors each layer keeps for backward, by shape."""
    plan = plan_memory(load_config(TINY))
    act = plan.activations
    batch, length, hidden, heads, experts, inner, vocab, layers = 4, 8, 32, 4, 4, 24, 67, 2
    n = batch * length
    norm = [(n, hidden), (n, hidden), (n, 1)]                    # input, output, 1 / rms
    attention = [(n, hidden)] * 4 + [(batch, heads, length, length)]   # q, k, v, mixed; probs
    moe = [(n, experts)] + [(experts, n, inner)] * 4 + [(experts, n, hidden)]
    # the stacked gate, up and down weights of the batched matmul: copies autograd keeps (the
    # memory bench counted them with saved-tensor hooks: 12.0 MiB a layer at 8 x 128 x 1024)
    moe += [(experts, hidden, inner)] * 3
    layer = sum(math.prod(s) for s in 2 * norm + attention + moe) * 4
    assert act.per_layer_bytes == layer
    root = sum(math.prod(s) for s in [(n, hidden), (n, hidden), (n, 1)]) * 4 \
        + 2 * n * vocab * 4                                      # log-probs and their gradient
    largest = max(math.prod(s) for s in attention + moe) * 4     # one gradient beside it
    assert act.root_bytes == root and act.transient_bytes == largest
    assert act.plain_bytes == layers * layer + root + largest
    assert act.recompute_bytes == layers * n * hidden * 4 + layer + root + largest
    fit = plan.fit
    assert fit.with_activations_bytes == plan.context.as_implemented_bytes + act.plain_bytes
    assert fit.fits is None and not fit.uses_recompute          # CPU: no card to compare with


def test_ep_activations_count_routed_pairs_and_dispatch_buffers():
    hidden, inner, tokens, k = 32, 24, 32, 2
    for dispatcher in ("all-gather", "all-to-all"):
        act = plan_memory(_tiny(), PlanOptions(dispatcher=dispatcher)).activations
        pairs = tokens * k                                       # balanced routing
        assert act.routed_pairs == pairs
        assert act.moe_bytes == (tokens * 4 + pairs * (2 * hidden + 4 * inner)) * 4
        kept = (2 * tokens * hidden * 4 + 2 * tokens * k * 8 if dispatcher == "all-gather"
                else pairs * hidden * 4)
        assert act.dispatch_bytes == kept


@settings(max_examples=25, deadline=None)
@given(ep=st.sampled_from([1, 2, 4, 8]), world_factor=st.sampled_from([1, 2, 4]),
       micro=st.integers(1, 3), layers=st.integers(1, 3))
def test_ep_properties(ep, world_factor, micro, layers):
    world = ep * world_factor
    assume(world <= 8)                           # the most a CPU config allows
    cfg = from_dict({}, [f"launch.ranks={world}", f"model.expert_parallel={ep}",
                         "model.num_experts=8", "model.hidden_size=16", "model.num_heads=2",
                         "model.expert_hidden=8", f"model.num_layers={layers}",
                         f"train.micro_steps={micro}"])
    plan = plan_memory(cfg, PlanOptions(intra_node_gbps=50, inter_node_gbps=5))
    expert = 3 * 16 * 8
    per_rank = layers * (8 // ep) * expert
    if ep == 1:
        assert plan.experts is None and plan.comm.dispatcher is None
    else:
        # a rank gathers its experts only: E times fewer than every expert
        assert plan.experts.expert_elements == per_rank
        assert plan.experts.expert_elements * ep == layers * 8 * expert
        # every dim 0 (16 and 8) splits over EDP groups of world_factor ranks
        assert plan.experts.expert_shard_elements * world == layers * 8 * expert
    for row in plan.comm.rows:                   # the ring factor of the row's group
        ring = 2 * (row.group_size - 1) if row.collective == "all-reduce" else \
            row.group_size - 1
        if row.collective != "all-to-all":
            assert math.isclose(row.bytes, row.full_bytes * ring / row.group_size, abs_tol=1)
    once = plan_memory(from_dict({}, [*cfg_overrides(cfg), "train.micro_steps=1"]),
                       PlanOptions(intra_node_gbps=50, inter_node_gbps=5))
    gathers = [r for r in plan.comm.rows if r.collective != "reduce-scatter"
               or "outputs" in r.what]
    for row in gathers:                          # gathers and dispatch run every micro-step
        assert row.bytes == micro * _rows(once)[row.what].bytes, row.what


def cfg_overrides(cfg) -> list:
    m = cfg.model
    return [f"launch.ranks={cfg.launch.ranks}", f"model.expert_parallel={m.expert_parallel}",
            f"model.num_experts={m.num_experts}", f"model.hidden_size={m.hidden_size}",
            f"model.num_heads={m.num_heads}", f"model.expert_hidden={m.expert_hidden}",
            f"model.num_layers={m.num_layers}"]


# -- the 671B configs --------------------------------------------------------------------------
def test_the_671b_ep_config_fits_a_64_gib_card_with_activations_and_recompute():
    cfg = load_config(BIG_EP)
    plan = plan_memory(cfg)
    m = cfg.model
    assert m.expert_parallel == 64 and cfg.fully_shard.mesh_shape == (4, 512)
    expert = 3 * m.hidden_size * m.expert_hidden
    ex = plan.experts
    assert ex.experts_per_rank == 4 and ex.edp_ranks == 32
    assert ex.expert_elements == m.num_layers * 4 * expert
    assert ex.expert_shard_elements == m.num_layers * 4 * expert // 32   # 7168, 2048 split in 32
    fit = plan.fit
    assert fit.device_memory_bytes == 64 * GIB
    assert fit.uses_recompute and fit.fits and fit.with_recompute_bytes < 64 * GIB
    assert fit.with_activations_bytes > 64 * GIB
    # main_grad lands in backward, two units' reduce outputs in flight at most
    assert fit.verdict.startswith("with full recompute, 59% of it")
    # all-to-all: per layer and phase, the 4096 tokens x 8 routes sent out and back, 63/64 of
    # them to other ranks; with recompute the forward's dispatch runs again
    rows = _rows(plan)
    per_phase = 61 * 2 * 4096 * 8 * 7168 * 2 * 63 / 64
    for phase in ("forward", "backward", "recompute"):
        row = rows[f"token dispatch + combine, {phase} (all-to-all)"]
        assert row.bytes == per_phase and row.link == INTER
        # 56 of the 63 peers are on other nodes: off-node bytes at 25 GB/s, the rest on HCCS
        assert math.isclose(row.seconds, per_phase * 56 / 63 / 25e9)
    plain = plan_memory(load_config(BIG))
    assert plain.fit.fits is False and plain.fit.uses_recompute
    # says by how much and why: the gathered units of plain FSDP and the dense experts'
    # activations
    assert plain.fit.short_by_bytes == plain.fit.with_recompute_bytes - 64 * GIB > 0
    assert f"{plain.fit.short_by_bytes / GIB:.2f} GiB over" in plain.fit.verdict
    assert plain.params.total == plan.params.total


def test_the_671b_ep_config_passes_check_config_and_comments_every_key(capsys):
    assert main(["check-config", str(BIG_EP)]) == EXIT_OK
    capsys.readouterr()
    keys = 0
    for line in BIG_EP.read_text().splitlines():
        if re.match(r"^  \w+:", line):
            keys += 1
            assert "#" in line, f"uncommented key: {line}"
    assert keys == sum(len(v) for v in load_config(BIG_EP).to_dict().values())


def test_plan_command_prints_the_comm_table_and_the_fit(capsys):
    assert main(["plan", "--config", str(BIG_EP)]) == EXIT_OK
    out = capsys.readouterr().out
    assert "communication per rank per step" in out and "392 GB/s intra-node" in out
    assert "fits a 64.00 GiB card with activations: yes, with full recompute" in out
    assert "fits a 64.00 GiB card without activations: yes" in out
    assert main(["plan", "--config", str(TINY), "--json", "--intra-node-gbps", "10",
                 "--inter-node-gbps", "1", "--dispatcher", "all-to-all",
                 "--set", "launch.ranks=4", "--set", "model.expert_parallel=2"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["comm"]["intra_node_gbps"] == 10 and data["experts"]["dispatcher"] == "all-to-all"
    assert data["activations"]["plain_bytes"] > 0 and data["fit"]["fits"] is None


@pytest.mark.parametrize("argv, needle", [
    (["--intra-node-gbps", "0"], "--intra-node-gbps must be a finite number > 0"),
    (["--inter-node-gbps", "-1"], "--inter-node-gbps must be a finite number > 0"),
    (["--inter-node-gbps", "inf"], "--inter-node-gbps must be a finite number > 0"),
    (["--dispatcher", "ring"], "--dispatcher must be one of all-to-all, all-gather"),
    (["--set", "model.expert_parallel=3"], "model.expert_parallel"),
])
def test_plan_refuses_bad_ep_options_in_one_line(capsys, argv, needle):
    assert main(["plan", "--config", str(TINY), *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("config", [BIG, BIG_EP], ids=["fsdp", "ep"])
def test_docs_plan_shows_what_the_plan_prints(config):
    """docs/plan.md quotes `gradpool plan` on both 671B configs; the quote is today's output."""
    text = (ROOT / "docs" / "plan.md").read_text()
    name = f"configs/{config.name}"
    match = re.search(rf"\$ gradpool plan --config {re.escape(name)}\n(.*?)\n```", text, re.S)
    assert match, f"docs/plan.md quotes no `gradpool plan --config {name}`"
    assert match.group(1) == format_plan(plan_memory(load_config(config)), name)


def test_docs_plan_table_holds_both_plans_figures():
    from gradpool.app.plan import human
    text = (ROOT / "docs" / "plan.md").read_text()
    plans = [plan_memory(load_config(config)) for config in (BIG, BIG_EP)]
    rows = [line.strip("| ").split(" | ") for line in text.splitlines()
            if line.startswith(("| memory", "| sent over", "| copied by"))]
    cells = {row[0]: row[1:] for row in rows}
    assert cells["memory without activations (as implemented)"] == \
        [human(p.fit.without_activations_bytes) for p in plans]
    assert cells["memory with full recompute"] == [human(p.fit.with_recompute_bytes) for p in plans]
    assert cells["sent over the network (estimated communication time)"] == \
        [f"{human(p.comm.total_bytes)} ({p.comm.estimated_seconds:.1f} s)" for p in plans]
    assert cells["copied by the pool (estimated copy time)"] == \
        [f"{human(p.copy.bytes_copied_per_step)} written ({p.copy.estimated_seconds * 1e3:.0f} ms)"
         for p in plans]
