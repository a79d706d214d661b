"""The memory suite's MoE rows: the tiny DeepSeek model with expert-heavy sizes at one world size,
expert parallelism 1 (plain FSDP: every expert on every rank, gathered whole with its layer)
against E > 1 (a rank holds ``num_experts / E`` experts of each layer, their own unit sharded over
the ``W / E`` ranks holding the same experts), per-rank peak beside the plan's prediction.

The model is :class:`gradpool.app.model.TinyDeepSeekV3` built and sharded by
:func:`gradpool.app.train.build_sharded_model` from the :class:`RunConfig` of :func:`moe_config`,
and the plan (:func:`gradpool.app.plan.plan_memory`) reads the same config, so its
``parameter_specs`` are the built model's parameters, expert for expert.

Measured as the dense rows are (:mod:`benchmarks.memory_worker`): one process per configuration
(each EP its own msrun launch), the library's fixed costs paid first, ``growth`` = VmHWM above the
RSS right after the model is built. ``build_sharded_model`` draws every expert on every rank (the
values of the E=1 model) and keeps this rank's, so the baseline is taken between the build and the
first ``fully_shard``, after a collection and ``malloc_trim`` (the experts a rank dropped are
garbage then, and would otherwise sit in the baseline as free heap the run reuses unseen): the
``replicate`` hook of ``build_sharded_model`` runs exactly there and names no parameter, so the
sharding is the one ``gradpool train`` applies. The model memory at the peak, set against the
plan, is ``growth`` plus the parameters the rank built (its dense weights and its local experts,
all float32): ``fully_shard`` releases those and they are in the baseline. Unlike the dense
rows the plan's figure includes its activation estimate (every layer's, no recompute): with E=1
every expert runs on every token, and that is not negligible here.

Training: plain mode (no ``main_grad``), float32 reduce, hand-written SGD (no optimizer state),
``reshard_after_forward`` on; the plan is asked with the same settings.

    msrun ... python -m gradpool.app._rank_entry benchmarks/memory_moe.py OUT_DIR --ep E [sizes]
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 2 ** 20
LEARNING_RATE = 1e-3
EXPERT = ".moe.experts."


@dataclass(frozen=True)
class MoeOptions:
    """The MoE stack and its runs. The defaults: 4 layers of 8 SwiGLU experts 128 -> 1024 -> 128
    (1.5 MiB an expert, 48 MiB of experts against 1.3 MiB of dense weights), top-2, 4 sequences
    of 8 tokens a rank (activations: tens of KiB a layer), at 4 ranks with EP 1, 2 and 4."""

    world: int = 4
    eps: tuple = (1, 2, 4)
    layers: int = 4
    experts: int = 8
    hidden: int = 128
    expert_hidden: int = 1024
    top_k: int = 2
    heads: int = 4
    batch: int = 4
    seq_len: int = 8
    steps: int = 3

    @classmethod
    def quick(cls) -> "MoeOptions":
        # the extremes only (a 4-rank launch costs ~15-25 s on 2 cores), 2 steps: every buffer
        # a step needs exists after the first
        return cls(eps=(1, 4), steps=2)

    def args(self) -> list:
        return ["--layers", str(self.layers), "--experts", str(self.experts),
                "--hidden", str(self.hidden), "--expert-hidden", str(self.expert_hidden),
                "--top-k", str(self.top_k), "--heads", str(self.heads),
                "--batch", str(self.batch), "--seq-len", str(self.seq_len),
                "--steps", str(self.steps)]

    @property
    def expert_bytes(self) -> int:
        """Every expert of every layer, float32."""
        return self.layers * self.experts * 3 * self.hidden * self.expert_hidden * 4


def moe_config(options: MoeOptions, ep: int):
    """The RunConfig the ranks build from and the plan reads."""
    from gradpool.app.config import from_dict
    o = options
    return from_dict({}, [
        f"launch.ranks={o.world}", f"model.expert_parallel={ep}",
        f"model.num_layers={o.layers}", f"model.num_experts={o.experts}",
        f"model.hidden_size={o.hidden}", f"model.expert_hidden={o.expert_hidden}",
        f"model.experts_per_token={o.top_k}", f"model.num_heads={o.heads}",
        f"model.batch_size={o.batch}", f"model.seq_len={o.seq_len}",
        "fully_shard.apply_grad_on_fp32_main_grad=false", "fully_shard.reduce_dtype=float32",
        "fully_shard.reshard_after_forward=true", "train.optimizer=sgd"])


@dataclass(frozen=True)
class MoePrediction:
    """The plan's figures for one EP, per rank."""

    with_activations_bytes: int       # what is set against the measured model memory at peak
    as_implemented_bytes: int         # the same without activations (what the dense rows use)
    activation_bytes: int             # every layer's, no recompute (dense E=1: every expert's)
    expert_shard_bytes: int           # the rank's shards of its experts (float32)
    gathered_at_once_bytes: int       # parameters gathered at the peak (root + two layers)
    largest_unit_grad_bytes: int      # one unit's full gradient in its backward
    pool_high_water_bytes: int
    built_bytes: int                  # the parameters a rank builds: dense + its experts
    built_expert_bytes: int


def predicted(options: MoeOptions, ep: int) -> MoePrediction:
    from gradpool.app.model import parameter_specs
    from gradpool.app.plan import local_expert_specs, plan_memory
    cfg = moe_config(options, ep)
    plan = plan_memory(cfg)
    held = local_expert_specs(parameter_specs(cfg.model), ep, cfg.model.num_experts)
    if plan.experts is not None:
        expert_shard = plan.experts.expert_shard_elements * 4
    else:       # E = 1: the experts are in their layers' units, sharded over every rank
        expert_shard = _expert_shard_elements(cfg) * 4
    return MoePrediction(
        with_activations_bytes=plan.fit.with_activations_bytes,
        as_implemented_bytes=plan.context.as_implemented_bytes,
        activation_bytes=plan.activations.plain_bytes, expert_shard_bytes=expert_shard,
        gathered_at_once_bytes=plan.context.gathered_at_once_bytes,
        largest_unit_grad_bytes=plan.context.largest_unit_grad_bytes,
        pool_high_water_bytes=plan.pool.high_water_bytes,
        built_bytes=sum(s.numel for s in held) * 4,
        built_expert_bytes=sum(s.numel for s in held if EXPERT in s.name) * 4)


def _expert_shard_elements(cfg) -> int:
    """E = 1: the experts' share of the rank's shards, as the plan lays them out (the same
    per-parameter dim-0 chunks its reduce layouts use)."""
    from gradpool.app.plan.geometry import _geometry
    geo = _geometry(cfg)
    return sum(slot.chunk_numel for unit in geo.units for r in unit.reduces
               for spec, slot in zip(r.specs, r.layout.slots) if EXPERT in spec.name)


@dataclass
class MoeRun:
    """One EP at ``world`` ranks: its per-rank records and the plan's prediction."""

    ep: int
    world: int
    records: list = field(default_factory=list)
    plan: Optional[MoePrediction] = None

    @property
    def name(self) -> str:
        return f"MoE W={self.world} EP={self.ep}"

    @property
    def growth_bytes(self) -> int:
        return max(r["growth_bytes"] for r in self.records)

    @property
    def held_bytes(self) -> int:
        """Model memory at the peak, largest rank: growth plus the parameters it built."""
        return max(r["growth_bytes"] + r["built_bytes"] for r in self.records)

    @property
    def pool_high_water_bytes(self) -> int:
        return max(r["pool_high_water_bytes"] for r in self.records)

    @property
    def gap(self) -> float:
        """The plan against the measurement: negative when it predicts less."""
        return self.plan.with_activations_bytes / self.held_bytes - 1


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f}"


def report_lines(options: MoeOptions, runs: list) -> list:
    o = options
    dense = runs[0].plan.built_bytes - runs[0].plan.built_expert_bytes if runs else 0
    lines = [f"  MoE W={o.world}: {o.layers} layers x {o.experts} experts {o.hidden} -> "
             f"{o.expert_hidden} -> {o.hidden} ({_mib(o.expert_bytes)} MiB of experts, "
             f"{_mib(dense)} MiB dense), top-{o.top_k}, {o.batch} x {o.seq_len} tokens a rank, "
             f"{o.steps} steps; model memory at peak = growth + the rank's built parameters"]
    for run in runs:
        per_rank = ", ".join(_mib(r["growth_bytes"]) for r in run.records)
        p = run.plan
        lines.append(
            f"    EP={run.ep}{' (plain FSDP)' if run.ep == 1 else ''}: growth per rank "
            f"{per_rank} MiB; built {_mib(p.built_bytes)} MiB ({_mib(p.built_expert_bytes)} of "
            f"experts); model memory at peak {_mib(run.held_bytes)} MiB, plan "
            f"{_mib(p.with_activations_bytes)} MiB ({run.gap:+.0%}; "
            f"{_mib(p.activation_bytes)} of it activations); pool high-water "
            f"{_mib(run.pool_high_water_bytes)} MiB (plan {_mib(p.pool_high_water_bytes)})")
    if runs:
        lines.append("moe: " + ", ".join(
            f"EP={r.ep} {_mib(r.held_bytes)} MiB (plan {_mib(r.plan.with_activations_bytes)})"
            for r in runs))
    return lines


# -- one rank ----------------------------------------------------------------------------------
def run_rank(options: MoeOptions, ep: int, rank: int, world: int, device: str) -> dict:
    """Build and shard the MoE model for ``ep`` (baseline in between), train, measure."""
    import mindspore as ms
    from mindspore import ops
    from benchmarks.memory_worker import Meter, _sync, prepay_library, read_status
    from gradpool.app.model import make_batch_np, next_token_loss
    from gradpool.app.train import build_sharded_model
    from gradpool.device import return_free_host_memory

    library_bytes = prepay_library()
    cfg = moe_config(options, ep)
    before_build = read_status()["VmRSS"]
    taken = {}

    def baseline_here(model):
        # build_sharded_model calls this between the build and the first fully_shard
        params = model.trainable_params()
        taken["built"] = sum(math.prod(p.shape) * 4 for p in params)
        taken["experts"] = sum(math.prod(p.shape) * 4 for p in params if EXPERT in p.name)
        gc.collect()
        return_free_host_memory()
        _sync()
        taken["meter"] = Meter(device)
        return []                   # no parameter kept whole

    start = time.perf_counter()
    model = build_sharded_model(cfg, replicate=baseline_here)
    meter = taken["meter"]
    sharded_rss = read_status()["VmRSS"] - meter.baseline
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda tokens: next_token_loss(model, tokens), None, params)
    losses, step_seconds, expert_rows, peaks = [], [], [], []
    for step in range(options.steps):
        began = time.perf_counter()
        model.zero_grad()
        tokens = ms.Tensor(make_batch_np(cfg.model, step, rank, world, seed=cfg.train.seed))
        loss, grads = grad_fn(tokens)
        for param, grad in zip(params, grads):
            ops.assign(param, param - LEARNING_RATE * grad)
        del grads
        _sync()
        losses.append(float(loss.asnumpy()))
        step_seconds.append(time.perf_counter() - began)
        expert_rows.append(_expert_rows(model, cfg, ep))
        peaks.append(meter.peak() - meter.baseline)     # where the growth happens
    peak = meter.peak()
    from gradpool.runtime import all_runtimes
    high_water = sum(rt.pool.stats().high_water_bytes for rt in all_runtimes())
    return {"rank": rank, "world": world, "ep": ep, "layers": options.layers,
            "experts": options.experts, "steps": options.steps,
            "before_build_bytes": before_build, "baseline_bytes": meter.baseline,
            "peak_bytes": peak, "growth_bytes": peak - meter.baseline,
            "growth_by_step": peaks, "after_shard_bytes": sharded_rss,
            "built_bytes": taken["built"], "built_expert_bytes": taken["experts"],
            "source": meter.source, "high_water_reset": meter.reset,
            "pool_high_water_bytes": high_water, "library_bytes": library_bytes,
            "losses": losses, "finite": all(math.isfinite(v) for v in losses),
            "expert_rows": expert_rows, "step_seconds": step_seconds,
            "seconds": time.perf_counter() - start, "pid": os.getpid()}


def _expert_rows(model, cfg, ep: int) -> int:
    """Rows this rank ran through expert MLPs in the last forward, every layer: the dense E=1
    product runs every expert on every token; E > 1 only the routed (token, expert) pairs."""
    if ep == 1:
        tokens = cfg.model.batch_size * cfg.model.seq_len
        return cfg.model.num_layers * cfg.model.num_experts * tokens
    return sum(layer.moe.experts.last.routed + layer.moe.experts.last.padding
               for layer in model.layers)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--ep", type=int, required=True, help="model.expert_parallel")
    defaults = MoeOptions()
    for key in ("layers", "experts", "hidden", "expert_hidden", "top_k", "heads", "batch",
                "seq_len", "steps"):
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, default=getattr(defaults, key))
    parser.add_argument("--device", default="CPU", choices=("CPU", "Ascend"))
    args = parser.parse_args(argv)

    import mindspore as ms
    ms.set_device(args.device)
    from gradpool.app import rank_report
    from gradpool.comm import init_distributed
    rank, world = init_distributed()        # in msrun's scheduler process this never returns
    if args.device == "CPU":
        from gradpool.device import block_launches       # as gradpool train does on CPU
        block_launches()
    options = MoeOptions(world=world, eps=(args.ep,), layers=args.layers, experts=args.experts,
                         hidden=args.hidden, expert_hidden=args.expert_hidden, top_k=args.top_k,
                         heads=args.heads, batch=args.batch, seq_len=args.seq_len,
                         steps=args.steps)
    record = run_rank(options, args.ep, rank, world, args.device)
    name = MoeRun(args.ep, world).name
    rank_report.reporter_for(args.out_dir, rank, world).publish_entry("runs", name, record)
    print(f"{name} rank {rank}: growth {record['growth_bytes'] / MIB:.1f} MiB, built "
          f"{record['built_bytes'] / MIB:.1f} MiB, pool high-water "
          f"{record['pool_high_water_bytes'] / MIB:.1f} MiB, steps "
          f"{', '.join(f'{t:.2f}' for t in record['step_seconds'])} s", flush=True)
    return 0 if record["finite"] else 1


if __name__ == "__main__":
    sys.exit(main())
