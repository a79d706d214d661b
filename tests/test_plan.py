"""`gradpool plan`: parameter shapes from the config alone equal the built model's, the replayed
pool high-water and bytes copied equal what the real pool measures on the tiny model, and the
DeepSeek-V3 671B plan is computed without a device, as a table and as JSON."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import mindspore as ms
import pytest

from gradpool.app import rank_main
from gradpool.app.cli import EXIT_OK, EXIT_USAGE, main
from gradpool.app.config import ModelConfig, load_config
from gradpool.app.model import TinyDeepSeekV3, parameter_specs
from gradpool.app.plan import (COPY_EFFICIENCY, HBM_910B_GBPS, PlanOptions, format_plan,
                               plan_memory)
from gradpool.errors import InvalidArgumentError
from gradpool.runtime import reset_runtimes

ms.set_device("CPU")     # at import: a fixture would come after other files ran kernels

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "deepseek3_tiny.yaml"
BIG = ROOT / "configs" / "deepseek3_671b_910b.yaml"
ASCEND_2 = ROOT / "configs" / "deepseek3_910b_2card.yaml"
TOLERANCE = 0.03        # "within a few percent"; the replay has matched the pool exactly


@pytest.mark.parametrize("model", [ModelConfig(), ModelConfig(
    vocab_size=11, hidden_size=12, num_layers=3, num_heads=3, num_experts=3,
    experts_per_token=1, expert_hidden=5)])
def test_parameter_specs_equal_the_built_models_parameters(model):
    built = [(p.name, tuple(p.shape)) for p in TinyDeepSeekV3(model).trainable_params()]
    assert [(s.name, s.shape) for s in parameter_specs(model)] == built


def test_parameter_specs_name_the_units_build_sharded_model_makes():
    from gradpool.app.train import build_sharded_model
    ms.set_device("CPU")
    reset_runtimes()
    try:
        cfg = load_config(TINY, ["launch.ranks=1"])
        model = build_sharded_model(cfg)
        units = {"root": [p.name for p in model._hsdp_state.params]}
        for index, layer in enumerate(model.layers):
            units[f"layers.{index}"] = [p.name for p in layer._hsdp_state.params]
    finally:
        reset_runtimes()
    planned: dict = {}
    for spec in parameter_specs(cfg.model):
        planned.setdefault(spec.unit, []).append(spec.name)
    assert planned == units


@pytest.fixture
def in_process(monkeypatch):
    from gradpool.app import rank_report
    for name in (rank_report.ENV_DIR, "RANK_ID", "MS_ROLE", "MS_WORKER_NUM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(rank_report, "_launched", None)
    reset_runtimes()
    yield
    reset_runtimes()


@pytest.mark.parametrize("overrides", [
    [],                                                   # one bucket per gradient
    ["fully_shard.comm_fusion=true"],                     # fused reduce buckets
    ["fully_shard.comm_fusion=true", "train.micro_steps=2", "gradpool.bucket_cap_mib=0.01"],
    ["gradpool.async_reduce=false"],                      # outputs back in each backward
    ["fully_shard.apply_grad_on_fp32_main_grad=false"],   # outputs are the gradients
], ids=["per-gradient", "fused", "fused-accumulate-small-cap", "sync", "no-main-grad"])
def test_plan_matches_the_pools_measured_high_water_on_the_tiny_model(tmp_path, in_process,
                                                                      overrides):
    cfg = load_config(TINY, ["launch.ranks=1", "train.steps=2", *overrides])
    outcome = rank_main.run_rank(cfg, tmp_path)
    assert outcome.ok, outcome.describe_error()
    measured = outcome.pool
    plan = plan_memory(cfg)
    planned = plan.pool.high_water_bytes
    assert abs(planned - measured["high_water_bytes"]) <= TOLERANCE * measured["high_water_bytes"], \
        (planned, measured)
    assert plan.copy.bytes_copied_per_step * 2 == measured["bytes_copied"]
    assert plan.pool.new_allocations_step1 == measured["new_allocations"]
    assert plan.pool.new_allocations_after_step1 == 0


def test_the_671b_plan_needs_no_model_and_no_device():
    start = time.monotonic()
    cfg = load_config(BIG)
    plan = plan_memory(cfg)
    assert time.monotonic() - start < 60
    m = cfg.model
    layer = 4 * m.hidden_size ** 2 + 2 * m.hidden_size + m.hidden_size * m.num_experts \
        + 3 * m.num_experts * m.hidden_size * m.expert_hidden
    total = m.num_layers * layer + 2 * m.vocab_size * m.hidden_size + m.hidden_size
    assert plan.params.total == total and 700e9 < total < 705e9
    assert (plan.mesh.replicate, plan.mesh.shard, plan.mesh.ranks) == (4, 512, 2048)
    shard = plan.params.shard_elements
    assert total / 512 <= shard < total / 512 * 1.01          # padded, never less than a share
    assert plan.params.main_grad_bytes == plan.params.shard_bytes == 4 * shard
    pool = plan.pool
    assert pool.new_allocations_after_step1 == 0
    # one bucket per gradient: at most the in-flight bound of the largest (embedding, head)
    assert not cfg.fully_shard.comm_fusion
    assert pool.input_peak_bytes <= pool.max_buckets_in_flight * pool.largest_input_bytes
    # main_grad mode: each output bucket goes back once added into main_grad; without it, once
    # copied into the gradient autograd owns (pool memory never leaves the pool). Asynchronous:
    # at most two units' reduces hold their outputs (older ones land as backward goes), so the
    # pool holds less than the shards they reduce into
    assert pool.output_bytes == 0 and pool.high_water_bytes < shard * 4
    no_main_grad = plan_memory(load_config(BIG, ["fully_shard.apply_grad_on_fp32_main_grad=false"]))
    assert no_main_grad.pool.output_bytes == 0
    assert no_main_grad.pool.high_water_bytes < pool.high_water_bytes
    assert plan.megatron.buffer_bytes >= 4 * total         # every gradient, float32
    assert plan.copy.estimate and plan.copy.hbm_gbps == HBM_910B_GBPS
    assert plan.copy.copy_efficiency == COPY_EFFICIENCY
    assert math.isclose(plan.copy.estimated_seconds,
                        (plan.copy.bytes_copied_per_step + plan.copy.bytes_read_per_step)
                        / (HBM_910B_GBPS * 1e9 * COPY_EFFICIENCY))
    assert plan.context.device_memory_bytes == 64 * 2 ** 30
    json.dumps(plan.to_dict())
    # fused: a layer's all-gather goes through one pool bucket of its full float32 size
    fused = plan_memory(load_config(BIG, ["fully_shard.comm_fusion=true"]))
    assert fused.pool.high_water_bytes > 4 * plan.context.largest_unit_gathered_bytes / 2


def test_ascend_fences_hold_inputs_until_waited_cpu_ones_do_not():
    ascend = plan_memory(load_config(ASCEND_2)).pool
    cpu = plan_memory(load_config(ASCEND_2, ["launch.device=CPU", "launch.devices=null"])).pool
    assert ascend.fences.startswith("until waited") and cpu.fences.startswith("complete")
    assert cpu.input_peak_bytes == cpu.largest_input_bytes
    assert cpu.largest_input_bytes < ascend.input_peak_bytes \
        <= 2 * ascend.largest_input_bytes


def test_plan_command_prints_a_table_and_json(capsys):
    assert main(["plan", "--config", str(TINY)]) == EXIT_OK
    table = capsys.readouterr().out
    assert "pool: high-water (replay of 2 steps)" in table and "86.50 KiB" in table
    assert "ESTIMATED copy time" in table and "1600 GB/s x 0.7" in table
    assert "Megatron-style full gradient buffer" in table and "upstream per-step" in table
    assert main(["plan", "--config", str(TINY), "--json", "--hbm-gbps", "800",
                 "--copy-efficiency", "0.5"]) == EXIT_OK
    data = json.loads(capsys.readouterr().out)
    assert data["copy"]["hbm_gbps"] == 800 and data["copy"]["copy_efficiency"] == 0.5
    assert data["pool"]["high_water_bytes"] == 86.5 * 1024


@pytest.mark.parametrize("argv, needle", [
    (["--copy-efficiency", "2"], "--copy-efficiency is a fraction"),
    (["--hbm-gbps", "0"], "--hbm-gbps must be a finite number > 0"),
    (["--set", "model.num_heads=5"], "not divisible"),
])
def test_plan_refuses_bad_options_in_one_line(capsys, argv, needle):
    assert main(["plan", "--config", str(TINY), *argv]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


def test_plan_options_are_checked():
    with pytest.raises(InvalidArgumentError):
        PlanOptions(hbm_gbps=float("nan"))
    with pytest.raises(InvalidArgumentError):
        PlanOptions(device_memory_gib=-1)
    assert "device" in format_plan(plan_memory(load_config(ASCEND_2)))


@pytest.mark.parametrize("async_reduce, micro, held_layers", [
    (True, 1, 6),     # asynchronous: every layer but the one in backward and the one before
    (False, 1, 7),    # synchronous: every layer but the one in backward has landed
    (True, 2, 8),     # each micro-step reduced: the first landed before the second's backward
])
def test_plan_counts_main_grad_from_its_first_landing(async_reduce, micro, held_layers):
    """main_grad is allocated when a unit's first reduced shard lands (not at zero_grad): the
    plan's per-rank figure counts, in the largest unit's backward, only the main_grad already
    landed by then, and takes the larger of that and the step's end (every main_grad landed,
    nothing gathered). The memory bench's stack: 8 layers of 64 x 64 and a root vector, 2 ranks."""
    from benchmarks.memory import stack_specs
    from gradpool.app.config import from_dict
    overrides = ["launch.ranks=2", "fully_shard.apply_grad_on_fp32_main_grad=true",
                 "fully_shard.reduce_dtype=float32", "train.optimizer=sgd",
                 f"gradpool.async_reduce={str(async_reduce).lower()}",
                 f"train.micro_steps={micro}", "fully_shard.all_reduce_every_micro_step=false"]
    plan = plan_memory(from_dict({}, overrides), specs=stack_specs(8, 64))
    layer_shard = 64 * 64 // 2 * 4
    assert plan.params.main_grad_bytes == 8 * layer_shard + 64 // 2 * 4
    # the root's vector counts with the landed ones (conservative: it lands last in backward)
    assert plan.params.main_grad_in_backward_bytes == held_layers * layer_shard + (
        64 // 2 * 4 if held_layers else 0)
    ctx = plan.context
    assert ctx.after_landing_bytes == ctx.state_and_pool_bytes
    assert ctx.in_backward_bytes == (ctx.state_and_pool_bytes - plan.params.main_grad_bytes
                                     + plan.params.main_grad_in_backward_bytes
                                     + ctx.gathered_at_once_bytes
                                     + ctx.largest_unit_grad_bytes)
    assert ctx.as_implemented_bytes == max(ctx.in_backward_bytes, ctx.after_landing_bytes)
