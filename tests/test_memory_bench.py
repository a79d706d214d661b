"""The memory benchmark: its model's specs, the plan it compares with, and a small real run
(one process unsharded, then 2 msrun ranks with reshard_after_forward on and off, the
collectives-only control, and the recompute pair). No memory figure of the dense stack is
asserted (RSS depends on the machine); the values trained are. The recompute pair is sized so
its dropped activations (16 MiB a rank) stand far above RSS noise: there its peak with recompute
must be below the one without. The MoE rows: the plan's expert figures against a hand count,
and a 2-rank run of EP 1 and EP 2 (two launches) checked against the unsharded model, the routed
rows and the plan's difference between the two."""
import re

import mindspore as ms
import numpy as np
import pytest

from benchmarks import memory, memory_moe
from benchmarks.memory_worker import build_stack

ms.set_device("CPU")


def test_stack_specs_are_the_built_stacks_parameters():
    model = build_stack(layers=3, hidden=8, seed=0)
    built = [(p.name, tuple(p.shape)) for p in model.trainable_params()]
    specs = memory.stack_specs(3, 8)
    assert sorted(built) == sorted((s.name, s.shape) for s in specs)
    assert {s.unit for s in specs} == {"root", "layers.0", "layers.1", "layers.2"}
    assert memory.MemoryOptions(layers=3, hidden=8).model_bytes == sum(
        p.asnumpy().nbytes for p in model.trainable_params())


@pytest.mark.parametrize("world", [2, 4])
def test_plan_holds_two_layers_gathered_with_reshard_and_every_layer_without(world):
    options = memory.MemoryOptions(layers=6, hidden=64)
    layer_bytes = 64 * 64 * 4
    on = memory.predicted_bytes(options, world, reshard=True)
    off = memory.predicted_bytes(options, world, reshard=False)
    assert off - on == (6 - 2) * layer_bytes
    # what is always held: this rank's shards (float32), one unit's full gradient, the pool
    assert on > options.model_bytes // world + 3 * layer_bytes


def test_memory_benchmark_small_run(tmp_path):
    # recompute pair: 4 blocks of 2048 x 512 float32 intermediates (4 MiB each) a rank
    options = memory.MemoryOptions(layers=2, hidden=128, batch=4, steps=2, worlds=(2,),
                                   timeout=300, recompute_layers=4, recompute_hidden=16,
                                   recompute_ffn=512, recompute_rows=2048, recompute_steps=1,
                                   recompute_alone=False,       # as --quick: no launch of its own
                                   moe=None,                    # test_moe_rows_small_run
                                   main_grad_row=False)         # test_main_grad_row_small_run
    result = memory.run(options, tmp_path)
    assert [r.name for r in result.runs] == ["unsharded", "W=2 reshard=True",
                                             "W=2 reshard=False"]
    on, off = result.run(2, True), result.run(2, False)
    assert [r["rank"] for r in on.records] == [0, 1] and len(off.records) == 2
    for run in (on, off):
        for record in run.records:
            assert record["finite"] and len(record["losses"]) == 2
            assert record["peak_bytes"] >= record["baseline_bytes"] > 0
    # resharding changes where parameters live, not what is computed: bit-identical losses
    assert [r["losses"] for r in on.records] == [r["losses"] for r in off.records]
    # before the first update rank 0 (input seed 1) computes the unsharded process's first loss
    first = result.unsharded.records[0]["losses"][0]
    assert on.records[0]["losses"][0] == pytest.approx(first, rel=1e-6)
    assert on.records[1]["losses"][0] != pytest.approx(first, rel=1e-3)     # other data
    # a step updates the weights the same way in both: the second losses differ from the first
    assert on.records[0]["losses"][1] != on.records[0]["losses"][0]
    lines = memory.report_lines(result)
    assert re.fullmatch(r"memory: W=2 -?\d+\.\d MiB \(-?\d+\.\d\dx unsharded\)", lines[-1]), \
        lines[-1]
    assert len(lines) == 8 and "plan" in lines[2]
    control = result.controls[2]
    assert [r["rank"] for r in control.records] == [0, 1]
    assert all(r["collectives_only"] and r["peak_bytes"] >= r["baseline_bytes"]
               for r in control.records)
    assert lines[4].startswith("  W=2 collectives only: growth ") and "net of it" in lines[4]
    _check_recompute_row(result.recompute)
    assert lines[5].startswith("  W=2 recompute: 4 blocks 16 -> 512 -> 16, 2048 rows a rank, "
                               "1 step(s), after the control in its ranks; peak per rank ")
    assert "activations recompute drops 16.0 MiB a rank (4 x 4.0 MiB" in lines[6]


@pytest.mark.distributed
def test_main_grad_row_small_run(tmp_path):
    """The main_grad row at 2 ranks, small: four processes (the stack and the tiny stack,
    unsharded and sharded), every one in main_grad mode measured from its start; rank 0's
    first loss is the unsharded process's (same weights, same batch), and the report's net
    figures are the records' differences."""
    options = memory.MemoryOptions(layers=2, hidden=128, batch=4, steps=2, worlds=(2,),
                                   tiny_hidden=16, timeout=300, moe=None)
    row = memory.run_main_grad_row(options, tmp_path)
    assert sorted(row.runs) == [(1, False), (1, True), (2, False), (2, True)]
    for (world, tiny), run in row.runs.items():
        assert [r["rank"] for r in run.records] == list(range(world))
        for record in run.records:
            assert record["main_grad"] and record["from_start"] and record["finite"]
            assert record["hidden"] == (16 if tiny else 128) and len(record["losses"]) == 2
            assert record["peak_bytes"] >= record["baseline_bytes"] > 0
    first = row.runs[(1, False)].records[0]["losses"][0]
    assert row.runs[(2, False)].records[0]["losses"][0] == pytest.approx(first, rel=1e-6)
    # the sharded process pays the library's fixed cost, which the tiny run measures
    assert all(r["library_bytes"] > 0 for r in row.runs[(2, True)].records)
    big, tiny = row.runs[(2, False)].records, row.runs[(2, True)].records
    assert row.net_bytes(2) == max(b["growth_bytes"] - t["growth_bytes"]
                                   for b, t in zip(big, tiny))
    assert row.ratio(2) == row.net_bytes(2) / row.net_bytes(1)
    lines = memory.main_grad_lines(options, row)
    assert lines[0].startswith("  main_grad mode, 2 x 128 x 128 float32, 2 steps, peak above "
                               "each process's start, net of the same run of 2 x 16 x 16")
    assert lines[1].startswith("    unsharded growth per rank ")
    assert lines[2].startswith("    W=2       growth per rank ")
    assert re.fullmatch(r"main_grad: W=2 -?\d+\.\d MiB \(-?\d+\.\d\dx unsharded\), net of the "
                        r"tiny model; unsharded -?\d+\.\d MiB", lines[3]), lines[3]


def _check_recompute_row(row):
    with_rc, without = row.with_recompute, row.without
    assert row.world == 2 and not row.alone
    assert [r["rank"] for r in with_rc.records] == [0, 1] == [r["rank"] for r in without.records]
    for on, off in zip(with_rc.records, without.records):
        assert on["recompute"] and not off["recompute"]
        assert on["finite"] and len(on["losses"]) == 1 == len(off["losses"])
        # one process: the pair shares a baseline, the lighter configuration first
        assert on["pid"] == off["pid"] and on["baseline_bytes"] == off["baseline_bytes"]
        # recompute rebuilds the same activations: the same loss, bit for bit
        assert on["losses"] == off["losses"]
        # the hooks count exactly what the block's code says it saves: tanh(x @ W_in)
        assert on["saved_per_block_bytes"] == 2048 * 512 * 4
    assert row.saved_bytes == 4 * 2048 * 512 * 4
    assert row.expected_drop_bytes == 3 * 2048 * 512 * 4
    # measured, per rank: the peak with recompute is below the one without, by at least half
    # of the 12 MiB it should lose (the rest is room for RSS noise, not a tolerance we expect
    # to use: the runs measured lost 95-112 % of it)
    for on, off in zip(with_rc.records, without.records):
        assert on["growth_bytes"] >= 0
        assert off["growth_bytes"] - on["growth_bytes"] > row.expected_drop_bytes // 2, (on, off)


def test_memory_options_refuse_bad_sizes():
    class Args:
        layers, hidden, batch, steps, worlds = 0, None, None, None, None
    with pytest.raises(SystemExit, match="--layers must be >= 1, got 0"):
        memory.options_from(Args(), memory.MemoryOptions())
    Args.layers, Args.worlds = None, [1, 2]
    with pytest.raises(SystemExit, match="--worlds must be >= 2"):
        memory.options_from(Args(), memory.MemoryOptions())
    Args.worlds = [2]
    assert memory.options_from(Args(), memory.MemoryOptions.quick()).worlds == (2,)


def test_the_memory_suite_refuses_ascend_from_the_command_in_one_line(capsys):
    from gradpool.app.cli import EXIT_USAGE, main
    assert main(["bench", "--suite", "memory", "--device", "Ascend"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "memory_worker.py under msrun with --device Ascend" in err and err.count("\n") == 1


# -- the MoE rows ------------------------------------------------------------------------------
def _moe_counts(o, ep):
    """Hand counts (elements) of the tiny DeepSeek model's parameters: the root's, one layer's
    dense ones, one expert's."""
    vocab = 67
    root = 2 * vocab * o.hidden + o.hidden                      # embed, head, final norm
    dense_layer = 2 * o.hidden + 4 * o.hidden ** 2 + o.hidden * o.experts   # norms, qkvo, router
    expert = 3 * o.hidden * o.expert_hidden                    # gate, up, down
    return root, dense_layer, expert


@pytest.mark.parametrize("world", [2, 4])
def test_moe_plan_holds_the_same_expert_shards_and_gathers_fewer_experts_with_ep(world):
    """The plan on the MoE rows' config against a hand count: every EP holds 1/W of the
    experts as shards (EP E: num_experts / E of them over W / E ranks), but EP 1 gathers two
    whole layers with every expert, EP E two layers with num_experts / E, and at E = W (one rank
    per expert group) none: its experts are whole on the rank."""
    o = memory.MoeOptions(world=world, layers=3, experts=8, hidden=64, expert_hidden=96)
    root, dense_layer, expert = _moe_counts(o, 1)
    figures = {}
    eps = sorted({1, 2, world})
    for ep in eps:
        p = memory.moe_predicted(o, ep)
        figures[ep] = p
        local = o.experts // ep
        assert p.built_expert_bytes == o.layers * local * expert * 4
        assert p.built_bytes == (root + o.layers * (dense_layer + local * expert)) * 4
        # dims 64 and 96 split evenly over 1, 2 and 4 ranks: no padding
        assert p.expert_shard_bytes == o.layers * o.experts * expert * 4 // world
        gathered_experts = local * expert if world // ep > 1 else 0
        assert p.gathered_at_once_bytes == (root + 2 * (dense_layer + gathered_experts)) * 4
    assert figures[1].largest_unit_grad_bytes == (dense_layer + o.experts * expert) * 4
    assert figures[world].largest_unit_grad_bytes == \
        max(dense_layer, o.experts // world * expert) * 4
    # the whole prediction falls with every doubling of E
    totals = [figures[ep].with_activations_bytes for ep in eps]
    assert totals == sorted(totals, reverse=True) and len(set(totals)) == len(eps)
    assert memory.MoeOptions(layers=3, experts=8, hidden=64, expert_hidden=96).expert_bytes == \
        3 * 8 * expert * 4


@pytest.mark.distributed
def test_moe_rows_small_run(tmp_path):
    """2 msrun ranks, EP 1 (plain FSDP) then EP 2 (each rank 2 of the 4 experts, whole): what
    each rank built, its first loss against the unsharded E=1 model on its own batch, the
    routed rows its experts computed, and its measured peak against EP 1's."""
    from gradpool.app.model import TinyDeepSeekV3, make_batch_np, next_token_loss

    # one step (the launches are the cost: ~15-40 s each on 2 shared cores); 9 MiB of experts
    moe = memory.MoeOptions(world=2, eps=(1, 2), layers=2, experts=4, hidden=128,
                            expert_hidden=768, steps=1)
    options = memory.MemoryOptions(timeout=300, moe=moe)
    runs = memory.run_moe_rows(options, tmp_path)
    assert [(r.ep, r.world, r.name) for r in runs] == [(1, 2, "MoE W=2 EP=1"),
                                                       (2, 2, "MoE W=2 EP=2")]
    root, dense_layer, expert = _moe_counts(moe, 1)
    cfg = memory_moe.moe_config(moe, 1)
    reference = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
    for run in runs:
        assert [r["rank"] for r in run.records] == [0, 1]
        for record in run.records:
            assert record["finite"] and len(record["losses"]) == 1
            local = moe.experts // run.ep
            assert record["built_bytes"] == (root + 2 * (dense_layer + local * expert)) * 4
            assert record["built_expert_bytes"] == 2 * local * expert * 4
            # before the first update a rank computes the E=1 model on its own batch; only the
            # summation order differs (dispatch, combine, the reduces), a few float32 ulps
            tokens = ms.Tensor(make_batch_np(cfg.model, 0, record["rank"], 2,
                                             seed=cfg.train.seed))
            want = float(next_token_loss(reference, tokens).asnumpy())
            assert record["losses"][0] == pytest.approx(want, rel=1e-5, abs=0.0)
    # sparse experts: over the EP group, every layer computes each gathered token on its
    # top-2 experts, plus at most one padding row per expert no row was routed to
    tokens = moe.batch * moe.seq_len
    rows = sum(r["expert_rows"][0] for r in runs[1].records)
    assert 2 * (2 * tokens) * 2 <= rows <= 2 * (2 * tokens) * 2 + 2 * moe.experts
    assert runs[0].records[0]["expert_rows"][0] == 2 * moe.experts * tokens     # dense E=1
    # measured: EP 2 holds less than EP 1 on every rank, by more than half of what the plan
    # says it should (the rest is room for RSS noise; the plan undercounts EP 1, see
    # docs/benchmarks/memory.md, so the measured difference is larger)
    planned = runs[0].plan.with_activations_bytes - runs[1].plan.with_activations_bytes
    assert planned > 12 * 2 ** 20
    for one, two in zip(runs[0].records, runs[1].records):
        held_one = one["growth_bytes"] + one["built_bytes"]
        held_two = two["growth_bytes"] + two["built_bytes"]
        assert held_one - held_two > planned // 2, (one, two)
    lines = memory_moe.report_lines(moe, runs)
    assert lines[0].startswith("  MoE W=2: 2 layers x 4 experts 128 -> 768 -> 128 (9.0 MiB "
                               "of experts")
    assert lines[1].startswith("    EP=1 (plain FSDP): growth per rank ")
    assert lines[2].startswith("    EP=2: growth per rank ")
    assert re.fullmatch(r"moe: EP=1 \d+\.\d MiB \(plan \d+\.\d\), EP=2 \d+\.\d MiB "
                        r"\(plan \d+\.\d\)", lines[3]), lines[3]
