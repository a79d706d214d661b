"""``python -m benchmarks.collectives``: the collectives a training step launches, counted on real
msrun ranks, beside the counts ``gradpool plan`` gives for the same configuration.

Every communicator of the run (the world's and each group's) is put behind a
:class:`gradpool.testing.RecordingCommunicator` (``install_runtime(config, wrap=log.wrap)``):
the collectives run as they would, and each launch is recorded with its group. A step is the
training step of ``gradpool train`` (zero_grad, the micro-steps' forward and backward, the
optimizer) plus, with ``clip``, ``clip_grad_norm_`` on the ``main_grad``\\ s: the one collective
a user asks for (an all-reduce per shard group). The plan's rows
(:mod:`gradpool.app.plan.comm`) name their group by role ("shard group", "replicate group",
"EDP group", "EP group"); the built model says which communicator plays each role, so the
recorded counts compare with the plan's per group. A group that is the whole world is recorded
as ``world``: the unit-order check's all-gathers (``gradpool.check_unit_order``) land there and
the plan does not count them, so with the check on the world's recorded count exceeds the plan's
by them; with it off, every launch is the plan's or the user's.

On CPU the all-to-all token dispatcher runs through a stand-in built from all-gathers
(:mod:`gradpool.app.moe_exchange`), so that dispatcher is not compared here; the all-gather one
(CPU's default) is.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "deepseek3_tiny.yaml"
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
WORLD = "world"
# Each case: (name, world size, overrides on the tiny config)
CASES = {
    2: [("fsdp", ["launch.ranks=2"]),
        ("ep", ["launch.ranks=2", "model.expert_parallel=2"])],
    4: [("hsdp", ["launch.ranks=4", "fully_shard.mesh_shape=[2, 2]",
                  "fully_shard.mesh_dim_names=[dp_replicate, fsdp]"])],
}
COMMON = ["model.num_layers=3", "fully_shard.apply_grad_on_fp32_main_grad=true",
          "gradpool.verify_gradients=false"]


@dataclass
class StepCounts:
    """What one configuration launched per step and rank, and what the plan says."""
    name: str
    rank: int
    recorded: list          # per step: {"kind|group": launches}
    roles: dict             # recorded group -> the plan's roles it plays
    planned: dict           # "kind|group" -> launches per step (the plan's, by recorded group)
    user: dict              # "kind|group" -> launches the step's clipping asked for

    def expected(self) -> dict:
        out = dict(self.planned)
        for key, n in self.user.items():
            out[key] = out.get(key, 0) + n
        return out


def _key(kind: str, group: str) -> str:
    return f"{kind}|{group}"


def group_roles(model) -> dict:
    """``{recorded group: [roles]}`` of a model built on a recording runtime: each unit's shard
    (experts: EDP) and replicate communicator, and each MoE layer's EP group."""
    roles: dict = {}

    def add(comm, role: str) -> None:
        if comm is not None and comm.world_size > 1:
            names = roles.setdefault(comm.group, [])
            if role not in names:
                names.append(role)
    for name, cell in model.cells_and_names():
        state = cell.__dict__.get("_hsdp_state")
        if state is not None:
            experts = name.endswith("moe.experts")
            add(state.reducer.comm, "EDP group" if experts else "shard group")
            add(state.reducer.replicate_comm, "replicate group")
        dispatch = getattr(cell, "dispatch", None)
        ep = getattr(dispatch, "ep", None)
        if ep is not None:
            add(ep.comm, "EP group")
    return roles


def planned_counts(cfg, roles: dict) -> dict:
    """The plan's launches per step by recorded group: ``{"kind|group": n}``."""
    from gradpool.app.plan import plan_memory
    by_role: dict = {}
    for row in plan_memory(cfg).comm.rows:
        role = row.group.split(" (")[0]
        by_role[(row.collective, role)] = by_role.get((row.collective, role), 0) + row.collectives
    out: dict = {}
    for group, names in roles.items():
        for (kind, role), n in by_role.items():
            if role in names:
                out[_key(kind, group)] = out.get(_key(kind, group), 0) + n
    unplaced = {k: n for k, n in by_role.items() if not any(k[1] in r for r in roles.values())}
    if unplaced:
        raise RuntimeError(f"plan rows with no group in the built model: {unplaced}")
    return out


def count_steps(cfg, steps: int = 2, clip: bool = True) -> StepCounts:
    """Train ``steps`` steps of ``cfg`` (already ``launch.ranks`` = this world) on a recording
    runtime; the launches of each step by group, and the plan's."""
    import mindspore as ms
    from gradpool.app.model import next_token_loss
    from gradpool.app.train import _batch, build_sharded_model, optimizer_for, optimizer_grads
    from gradpool.runtime import install_runtime, reset_runtimes
    from gradpool.testing import CollectiveLog
    from hyper_parallel.core.fully_shard.clip import clip_grad_norm_

    reset_runtimes()
    log = CollectiveLog()
    runtime = install_runtime(cfg.gradpool, wrap=log.wrap)
    try:
        model = build_sharded_model(cfg)
        roles = group_roles(model)
        params = model.trainable_params()
        grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
        optimizer = optimizer_for(cfg, params)
        comm = runtime.comm
        recorded, user = [], {}
        for step in range(steps):
            mark = log.mark()
            model.zero_grad()
            for micro in range(cfg.train.micro_steps):
                last = micro == cfg.train.micro_steps - 1
                model.set_requires_gradient_sync(last)
                _, grads = grad_fn(_batch(cfg, step, micro, comm.rank, comm.world_size))
            grads = optimizer_grads(cfg, params, grads)
            if clip:
                clip_mark = log.mark()
                clip_grad_norm_(params, max_norm=1e9, grads=list(grads))
                user = {_key(*k): n for k, n in log.counts(clip_mark).items()}
            optimizer(grads)
            recorded.append({_key(*k): n for k, n in log.counts(mark).items()})
    finally:
        reset_runtimes()
    return StepCounts(name="", rank=comm.rank, recorded=recorded, roles=roles,
                      planned=planned_counts(cfg, roles), user=user)


def report_lines(counts: StepCounts) -> list:
    """One line per (collective, group): recorded per step (the last step), the plan's, the
    user's (clipping) and whether they agree."""
    last, expected = counts.recorded[-1], counts.expected()
    lines = []
    for key in sorted(set(last) | set(expected)):
        kind, group = key.split("|")
        roles = "+".join(counts.roles.get(group, [])) or group
        got, want = last.get(key, 0), expected.get(key, 0)
        lines.append(f"collectives {counts.name} rank {counts.rank}: {kind:<14} over {group} "
                     f"({roles}): recorded {got:4d} per step, plan {counts.planned.get(key, 0):4d}"
                     f" + clipping {counts.user.get(key, 0)}  {'ok' if got == want else 'DIFFERS'}")
    return lines


def configs(world: int, order_check: bool = False):
    """``(name, cfg)`` of every case at ``world`` ranks, comm_fusion on and off."""
    from gradpool.app.config import load_config
    for name, overrides in CASES[world]:
        for fusion in (True, False):
            yield (f"{name} comm_fusion={str(fusion).lower()}",
                   load_config(CONFIG, COMMON + overrides + [
                       f"fully_shard.comm_fusion={str(fusion).lower()}",
                       f"gradpool.check_unit_order={str(order_check).lower()}"]))


def time_fusion(steps: int, layers: int = 3) -> dict:
    """Step seconds of the default tiny configuration (``layers`` decoder layers, main_grad mode,
    the order check on) with ``comm_fusion`` true and false: two models in this process, stepped
    in turn on the same batches, after one warm-up step each."""

    import mindspore as ms
    from gradpool.app.config import load_config
    from gradpool.app.model import next_token_loss
    from gradpool.app.train import _batch, build_sharded_model, optimizer_for, optimizer_grads
    from gradpool.comm import init_distributed
    rank, world = init_distributed()
    models = {}
    for fusion in ("true", "false"):
        cfg = load_config(CONFIG, [f"model.num_layers={layers}", f"launch.ranks={world}",
                                   f"fully_shard.comm_fusion={fusion}"])
        model = build_sharded_model(cfg)
        params = model.trainable_params()
        grad_fn = ms.value_and_grad(lambda t, m=model: next_token_loss(m, t), None, params)
        models[fusion] = (cfg, model, params, grad_fn, optimizer_for(cfg, params), [])
    for step in range(1 + steps):
        for cfg, model, params, grad_fn, optimizer, seconds in models.values():
            start = time.perf_counter()
            model.zero_grad()
            _, grads = grad_fn(_batch(cfg, step, 0, rank, world))
            optimizer(optimizer_grads(cfg, params, grads))
            if step:
                seconds.append(time.perf_counter() - start)
    return {f"comm_fusion={k}": statistics.median(v[-1]) for k, v in models.items()}


def _rank_main(out_dir: Path, world: int, order_check: bool) -> None:
    import mindspore as ms
    from gradpool.comm import init_distributed
    ms.set_device("CPU")
    rank, _ = init_distributed()
    if os.environ.get("GRADPOOL_TIME_FUSION"):
        from gradpool.device import block_launches
        block_launches()            # as gradpool train runs CPU ranks
        (out_dir / f"fusion_{rank}.json").write_text(json.dumps(
            time_fusion(int(os.environ["GRADPOOL_TIME_FUSION"]))))
        return
    results = []
    for name, cfg in configs(world, order_check):
        counts = count_steps(cfg)
        counts.name = name
        results.append(counts.__dict__)
    (out_dir / f"counts_{rank}.json").write_text(json.dumps(results))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, choices=sorted(CASES), default=2)
    parser.add_argument("--order-check", action="store_true",
                        help="gradpool.check_unit_order on (its world all-gathers show)")
    parser.add_argument("--rank-side", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--time-fusion", type=int, default=0, metavar="STEPS",
                        help="instead: time STEPS steps with comm_fusion true and false, in turn "
                             "(3 decoder layers, the default configuration), in --runs launches")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.rank_side is not None:
        _rank_main(args.rank_side, args.ranks, args.order_check)
        return 0
    from gradpool.app.launch import run_ranks
    if args.time_fusion:
        return _time_fusion_runs(args.ranks, args.time_fusion, args.runs)
    out = Path(tempfile.mkdtemp(prefix="gradpool-collectives-"))
    run_ranks(Path(__file__), args=["--rank-side", str(out), "--ranks", str(args.ranks)]
              + (["--order-check"] if args.order_check else []), nproc=args.ranks,
              log_dir=out / "logs", timeout=1200)
    agree = True
    for rank in range(args.ranks):
        for data in json.loads((out / f"counts_{rank}.json").read_text()):
            counts = StepCounts(**data)
            for line in report_lines(counts):
                print(line)
                agree &= line.endswith("ok")
    return 0 if agree else 1


def _time_fusion_runs(ranks: int, steps: int, runs: int) -> int:
    from gradpool.app.launch import run_ranks
    ratios = []
    for index in range(runs):
        out = Path(tempfile.mkdtemp(prefix="gradpool-fusion-"))
        run_ranks(Path(__file__), args=["--rank-side", str(out), "--ranks", str(ranks)],
                  nproc=ranks, log_dir=out / "logs", timeout=3600,
                  env={"GRADPOOL_TIME_FUSION": str(steps)})
        medians = json.loads((out / "fusion_0.json").read_text())
        fused, unfused = medians["comm_fusion=true"], medians["comm_fusion=false"]
        ratios.append(unfused / fused)
        print(f"comm_fusion run {index + 1}: {ranks} ranks, 3 layers, median of {steps} steps in "
              f"turn: fused {fused * 1e3:.1f} ms, unfused {unfused * 1e3:.1f} ms "
              f"(unfused / fused {unfused / fused:.2f}x)", flush=True)
    ratios.sort()
    print(f"comm_fusion over {runs} runs: unfused / fused min / median / max "
          f"{ratios[0]:.2f}x / {statistics.median(ratios):.2f}x / {ratios[-1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
