"""Collectives per step and rank, recorded on real msrun ranks, against the plan and the design
(``benchmarks/collectives.py`` records them; ``python -m benchmarks.collectives`` prints them).

Folded into existing launches: dense FSDP and EP 2 at 2 ranks (fsdp_cases.py), HSDP (2, 2) at 4
ranks (hsdp_cases.py), each with ``comm_fusion`` true and false. The design, counted from the
built model independently of the plan: with ``comm_fusion`` one all-gather per unit in forward
and one per layer in backward (``reshard_after_forward``), one reduce-scatter per unit (and one
replicate all-reduce per unit under HSDP); without it one of each per parameter. The user's
``clip_grad_norm_`` adds one all-reduce over the shard group; nothing else may run over the
world.

``gradpool.check_unit_order`` is on (the default): its tag travels inside the unit's own
collectives, so the counts are the design's with it; ``strict`` would add one world all-gather
before every unit collective.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))      # the repository: benchmarks

from harness import equal

ORDER_CHECK = True
STEPS = 2
COMMON = ["model.num_layers=2", "fully_shard.apply_grad_on_fp32_main_grad=true",
          "gradpool.verify_gradients=false", f"gradpool.check_unit_order={str(ORDER_CHECK).lower()}"]
SETUPS = {
    "fsdp": ["launch.ranks=2"],
    "ep": ["launch.ranks=2", "model.expert_parallel=2"],
    "hsdp": ["launch.ranks=4", "fully_shard.mesh_shape=[2, 2]",
             "fully_shard.mesh_dim_names=[dp_replicate, fsdp]"],
}


def _config(setup: str, fusion: bool):
    from benchmarks.collectives import CONFIG
    from gradpool.app.config import load_config
    return load_config(CONFIG, COMMON + SETUPS[setup] + [
        f"fully_shard.comm_fusion={str(fusion).lower()}"])


def _designed(model, fusion: bool, experts_apart: bool) -> dict:
    """{(collective, role): launches per step} of the dense units, from the model itself
    (``experts_apart``: under EP the experts are units of their own, over the EDP group)."""
    units = {}
    for name in (p.name for p in model.trainable_params()):
        if experts_apart and ".moe.experts." in name:
            continue
        unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "root"
        units[unit] = units.get(unit, 0) + 1
    per = {u: (1 if fusion else n) for u, n in units.items()}
    layers = sum(n for u, n in per.items() if u != "root")
    return {("all-gather", "shard group"): sum(per.values()) + layers,
            ("reduce-scatter", "shard group"): sum(per.values()),
            ("all-reduce", "replicate group"): sum(per.values())}


def count_case(setup: str, fusion: bool):
    def case(ctx):
        from benchmarks.collectives import _key, count_steps
        counts = count_steps(_config(setup, fusion), steps=STEPS)
        checks = {f"step {s + 1} as the plan says, plus clipping": equal(step, counts.expected())
                  for s, step in enumerate(counts.recorded)}
        # nothing over the world but what the plan or the user asked for
        world = [k for k in counts.recorded[-1] if k.endswith("|world")]
        checks["world collectives are the plan's or the user's"] = equal(
            {k: counts.recorded[-1][k] for k in world},
            {k: counts.expected().get(k, 0) for k in world})
        checks["clipping: one all-reduce over the shard group"] = equal(
            [(k.split("|")[0], counts.roles.get(k.split("|")[1])) for k in counts.user],
            [("all-reduce", ["shard group"])] if setup != "ep"
            else [("all-reduce", ["shard group", "EP group"])])
        # the design, counted from the model: plan and code must both say this
        designed = _designed(_model_for_design(setup, fusion), fusion, setup == "ep")
        for (kind, role), want in designed.items():
            groups = [g for g, roles in counts.roles.items() if role in roles]
            if not groups:
                continue            # no replicate group outside HSDP
            if setup == "ep" and kind == "all-gather":
                # the dispatcher's all-gathers share the group: 2 per layer (forward tokens and
                # routing, backward output gradients)
                want += 2 * 2
            if setup == "ep" and kind == "reduce-scatter":
                want += 2 * 2
            checks[f"{kind} over the {role} as designed"] = equal(
                sum(counts.recorded[-1].get(_key(kind, g), 0) for g in groups)
                - sum(counts.user.get(_key(kind, g), 0) for g in groups), want)
        return checks
    return case


def _model_for_design(setup: str, fusion: bool):
    """The parameter names of the model of ``setup`` (unsharded, E = 1: names only)."""
    from dataclasses import replace
    from gradpool.app.model import TinyDeepSeekV3
    cfg = _config(setup, fusion)
    return TinyDeepSeekV3(replace(cfg.model, expert_parallel=1), seed=0)


def add_cases(suite, setups) -> None:
    for setup in setups:
        for fusion in (True, False):
            suite.add(f"collectives_{setup}_comm_fusion_{str(fusion).lower()}",
                      count_case(setup, fusion))
