"""The memory benchmark: its model's specs, the plan it compares with, and a small real run
(one process unsharded, then 2 msrun ranks with reshard_after_forward on and off, the
collectives-only control, and the recompute pair). No memory figure of the dense stack is
asserted (RSS depends on the machine); the values trained are. The recompute pair is sized so
its dropped activations (16 MiB a rank) stand far above RSS noise: there its peak with recompute
must be below the one without."""
import re

import mindspore as ms
import numpy as np
import pytest

from benchmarks import memory
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
                                   recompute_alone=False)       # as --quick: no launch of its own
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
