"""Checkpoint cases on msrun ranks (tests/test_checkpoint_distributed.py launches them in phases:
2 ranks save, 4 ranks load and save flat and HSDP (2, 2), 2 ranks load those back).

What a rank held is checked independently of the code under test: every rank dumps its raw
local tensors (padded shards as the Parameters hold them, with their shard geometry) to an
``.npz``, and the pytest side assembles full tensors from those dumps with NumPy and compares
the saving run's against the loading run's, bit for bit.

The shared directory comes in ``CHECKPOINT_SHARED`` (the same for every phase).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import mindspore as ms
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gradpool.app.config import from_dict
from gradpool.app.model import next_token_loss
from gradpool.app.train import _batch, build_sharded_model, optimizer_for, optimizer_grads
from gradpool.errors import CheckpointError, StateMismatchError
from harness import Context, Suite, equal, raises
from hyper_parallel import (ShardedTensor, checkpoint, get_model_state_dict,
                            get_optimizer_state_dict, set_model_state_dict,
                            set_optimizer_state_dict)
from hyper_parallel.core.dtensor.placement_types import Shard

suite = Suite("checkpoint", blocking_launch=True)
SHARD_DIM_1 = "layers.1.attn.q"
REPLICATED = "layers.0.attn_norm.weight"
# 3 experts: at 4 ranks one rank's expert shard is empty; vocab 67 is uneven at 2 and 4.
MODEL = ["model.num_experts=3", "model.experts_per_token=2", "train.optimizer=adam",
         "gradpool.poison_on_release=true"]
FLAT = []
HSDP = ["fully_shard.mesh_shape=[2, 2]", "fully_shard.mesh_dim_names=[dp_replicate, fsdp]",
        "launch.ranks=4"]      # a mesh covers launch.ranks


# Expert parallelism (4 experts; EP groups of consecutive ranks, experts sharded over the ranks
# holding the same ones): saved at 4 ranks with EP 2 ("e2"), loaded at EP 4 and EP 1 (4 ranks),
# at 2 ranks with EP 2 and EP 1, and unsharded in the pytest process.
EXPERTS = ["model.num_experts=4", "launch.ranks=4"]
EP2, EP4, EP1 = (EXPERTS + ["model.expert_parallel=2"], EXPERTS + ["model.expert_parallel=4"],
                 EXPERTS)
EP2_AT_2, EP1_AT_2 = (["model.num_experts=4", "model.expert_parallel=2"],
                      ["model.num_experts=4"])


def shared() -> Path:
    return Path(os.environ["CHECKPOINT_SHARED"])


def _placement(param):
    return Shard(1) if param.name == SHARD_DIM_1 else None


def build(mesh: list, seed: int = 1234):
    """The tiny model sharded as the training job shards it (one Shard(1) parameter, one
    replicated), and its Adam optimizer."""
    cfg = from_dict({}, MODEL + mesh + [f"train.seed={seed}"])
    model = build_sharded_model(cfg, replicate=lambda m: [p for p in m.trainable_params()
                                                          if p.name == REPLICATED],
                                shard_placement_fn=_placement)
    return cfg, model, optimizer_for(cfg, model.trainable_params())


def train(cfg, model, optimizer, ctx: Context, steps: int) -> None:
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda tokens: next_token_loss(model, tokens), None, params)
    for step in range(steps):
        if hasattr(model, "zero_grad"):          # a fully_shard model (not an unsharded one)
            model.zero_grad()
        _, grads = grad_fn(_batch(cfg, step, 0, ctx.rank, ctx.world_size))
        optimizer(optimizer_grads(cfg, params, grads))


def _geometry(param) -> dict:
    managed = getattr(param, "hsdp_param", None)
    if managed is None or managed.replicate:
        return {"shard_dim": -1, "shape": list(param.shape)}
    replicas = managed.unit.reducer.replicate_comm
    return {"shard_dim": managed.shard_dim, "shape": list(managed.orig_shape),
            "shard_rank": managed.rank, "replica": 0 if replicas is None else replicas.rank}


def dump(tag: str, ctx: Context, model, optimizer) -> None:
    """This rank's raw local tensors and their geometry (the independent reference)."""
    arrays, geometry = {}, {}
    model_params = {p.name: p for p in model.parameters_dict().values()}
    for name, param in model_params.items():
        arrays["model/" + name] = param.asnumpy().copy()
        geometry["model/" + name] = _geometry(param)
    owners = {id(p) for p in model_params.values()}
    for name, state in optimizer.parameters_dict().items():
        if id(state) in owners:
            continue
        arrays["optimizer/" + name] = state.asnumpy().copy()
        prefix, _, rest = name.partition(".")
        owner = model_params.get(rest)
        sharded_like = owner is not None and tuple(state.shape) == tuple(owner.shape)
        geometry["optimizer/" + name] = _geometry(owner) if sharded_like else \
            {"shard_dim": -1, "shape": list(state.shape)}
    target = shared() / "raw" / tag
    target.mkdir(parents=True, exist_ok=True)
    np.savez(target / f"rank{ctx.rank}.npz", **arrays)
    (target / f"rank{ctx.rank}.json").write_text(json.dumps(
        {"world_size": ctx.world_size, "geometry": geometry}))


def _digest(values: dict) -> dict:
    return {k: float(np.abs(v.astype(ms.float32).asnumpy()).sum()) for k, v in values.items()}


# -- phase 1: 2 ranks ---------------------------------------------------------------------------
@suite.case
def w2_save(ctx):
    cfg, model, optimizer = build(FLAT)
    train(cfg, model, optimizer, ctx, steps=2)
    result = checkpoint.save(shared() / "w2", model, optimizer, step=2, extra={"from": "w2"})
    dump("w2", ctx, model, optimizer)
    again = checkpoint.save(shared() / "w2", model, optimizer, step=2, extra={"from": "w2"})
    generations = sorted(p.name for p in (shared() / "w2").glob("gen-*"))
    return {"bytes": equal(result.bytes_written > 0, True),
            "total": equal(result.total_bytes >= result.bytes_written, True),
            "resave_keeps_one_generation": equal(generations, [f"gen-{again.generation:08d}"])}


@suite.case
def w2_async_save_while_training(ctx):
    """The same training as w2_save, saved in the background while the next step runs (its
    collectives on this thread, its optimizer changing the parameters in place); the pytest
    side loads it at world 1 and compares it with w2's dump, bit for bit."""
    cfg, model, optimizer = build(FLAT)
    train(cfg, model, optimizer, ctx, steps=2)
    handle = checkpoint.save(shared() / "w2a", model, optimizer, step=2, extra={"from": "w2a"},
                             async_save=True)
    train(cfg, model, optimizer, ctx, steps=1)
    uncommitted = not (shared() / "w2a" / "index.json").exists()
    result = handle.wait()
    return {"step": equal(result.step, 2), "asynchronous": equal(result.asynchronous, True),
            "uncommitted_before_the_wait": equal(uncommitted, True),
            "total": equal(result.total_bytes >= result.bytes_written > 0, True)}


@suite.case
def w2_load_into_other_seed(ctx):
    """A model built from another seed takes the saved values (dumped for the pytest side)."""
    _, model, optimizer = build(FLAT, seed=99)
    loaded = checkpoint.load(shared() / "w2", model, optimizer)
    dump("w2_at_w2", ctx, model, optimizer)
    return {"step": equal(loaded["step"], 2), "extra": equal(loaded["extra"], {"from": "w2"})}


@suite.case
def w2_full_state_dict_is_the_same_on_every_rank(ctx):
    """The full form: unpadded global shapes under the unsharded names, the same values on
    both ranks (their sums compared through the pytest side), loaded back exactly."""
    cfg, model, optimizer = build(FLAT)
    train(cfg, model, optimizer, ctx, steps=1)
    full = get_model_state_dict(model, full_state_dict=True)
    full_opt = get_optimizer_state_dict(model, optimizer, full_state_dict=True)
    _, other, other_opt = build(FLAT, seed=5)
    set_model_state_dict(other, full)
    set_optimizer_state_dict(other, other_opt, full_opt)
    again = get_model_state_dict(other, full_state_dict=True)
    again_opt = get_optimizer_state_dict(other, other_opt, full_state_dict=True)
    return {"shapes": equal({k: list(v.shape) for k, v in full.items()} == {
                k: list(p.hsdp_param.orig_shape if getattr(p, "hsdp_param", None) else p.shape)
                for k, p in model.parameters_dict().items()}, True),
            "digest": equal(_digest(full), _digest(full)),   # compared across ranks in pytest
            "round_trip": equal(all(np.array_equal(full[k].asnumpy(), again[k].asnumpy())
                                    for k in full), True),
            "optimizer_round_trip": equal(all(np.array_equal(full_opt[k].asnumpy(),
                                                             again_opt[k].asnumpy())
                                              for k in full_opt), True)}


@suite.case
def w2_sharded_state_dict_round_trip_and_refusal(ctx):
    cfg, model, optimizer = build(FLAT)
    train(cfg, model, optimizer, ctx, steps=1)
    sharded = get_model_state_dict(model)
    first = next(k for k, v in sharded.items() if isinstance(v, ShardedTensor))
    _, other, _ = build(FLAT, seed=5)
    set_model_state_dict(other, sharded)
    same = all(np.array_equal(p.asnumpy(), q.asnumpy()) for p, q in
               zip(model.trainable_params(), other.trainable_params()))
    # another rank's shard (offsets moved): this rank's part is not in it
    moved = dict(sharded)
    value = sharded[first]
    offsets = list(value.offsets)
    offsets[0] = 0 if offsets[0] else value.global_shape[0] - value.local.shape[0]
    moved[first] = ShardedTensor(value.local, value.global_shape, tuple(offsets))
    before = [p.asnumpy().copy() for p in other.trainable_params()]
    refused = raises(StateMismatchError, lambda: set_model_state_dict(other, moved), first,
                     "load a full state dict or a checkpoint")
    unchanged = all(np.array_equal(a, p.asnumpy()) for a, p in zip(before, other.trainable_params()))
    return {"round_trip": equal(same, True), "refused": refused, "unchanged": equal(unchanged, True)}


@suite.case
def w2_mismatched_checkpoint_refused_model_unchanged(ctx):
    cfg = from_dict({}, ["model.hidden_size=16", "model.num_experts=3"])
    model = build_sharded_model(cfg)
    before = [p.asnumpy().copy() for p in model.trainable_params()]
    refused = raises(StateMismatchError, lambda: checkpoint.load(shared() / "w2", model),
                     "model/embed", "(67, 32)", "(67, 16)")
    unchanged = all(np.array_equal(a, p.asnumpy()) for a, p in zip(before, model.trainable_params()))
    return {"refused": refused, "unchanged": equal(unchanged, True)}


@suite.case
def w2_truncated_file_refused_by_name(ctx):
    target = shared() / "w2_truncated"
    if ctx.rank == 0:
        shutil.copytree(shared() / "w2", target)
        victim = next(target.glob("gen-*/rank-00000.safetensors"))
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
    _barrier(ctx)
    _, model, optimizer = build(FLAT, seed=7)
    before = [p.asnumpy().copy() for p in model.trainable_params()]
    # rank 0's file holds the whole tensors (replicated, optimizer scalars): every rank reads it
    refused = raises(CheckpointError, lambda: checkpoint.load(target, model, optimizer),
                     "rank-00000.safetensors", "truncated")
    unchanged = all(np.array_equal(a, p.asnumpy()) for a, p in zip(before, model.trainable_params()))
    return {"refused": refused, "unchanged": equal(unchanged, True)}


@suite.case
def w2_one_rank_fails_to_read_every_rank_unchanged(ctx):
    """Load agreement between real ranks: rank 1's own file is damaged (a flipped byte in its
    shards, a file rank 0 does not read), so rank 1's read fails its checksum; every rank
    raises before any rank assigns, and every model is unchanged."""
    target = shared() / "w2_rank1_damaged"
    if ctx.rank == 0:
        shutil.copytree(shared() / "w2", target)
        victim = next(target.glob("gen-*/rank-00001.safetensors"))
        data = bytearray(victim.read_bytes())
        data[-3] ^= 0x10                      # the last tensor's bytes: rank 1's shards
        victim.write_bytes(bytes(data))
    _barrier(ctx)
    _, model, optimizer = build(FLAT, seed=7)
    before = [p.asnumpy().copy() for p in model.trainable_params()]
    said = ("rank-00001.safetensors", "checksum") if ctx.rank == 1 else (
        "failed to load on 1 other rank", "unchanged")
    refused = raises(CheckpointError, lambda: checkpoint.load(target, model, optimizer), *said)
    unchanged = all(np.array_equal(a, p.asnumpy()) for a, p in zip(before, model.trainable_params()))
    return {"refused": refused, "unchanged": equal(unchanged, True)}


@suite.case
def w2_ranks_that_find_different_latest_all_refuse(ctx):
    """``train.resume_from: latest`` resolved by the ranks (launch-cmd's way) over the real
    exchange: where rank 0 finds step 4 and rank 1 finds none, both refuse; where both find
    step 4, both resume it."""
    from gradpool.app.rank_main import _resolve_latest
    from hyper_parallel.checkpoint.steps import step_dir
    cfg, model, optimizer = build(FLAT)
    checkpoint.save(step_dir(shared() / "latest_a", 4), model, optimizer, step=4)
    mine = shared() / ("latest_a" if ctx.rank == 0 else "latest_empty")
    mine.mkdir(exist_ok=True)
    apart = from_dict({}, [f"train.save_dir={mine}", "train.resume_from=latest"])
    together = from_dict({}, [f"train.save_dir={shared() / 'latest_a'}",
                              "train.resume_from=latest"])
    resolved = _resolve_latest(together, ctx.comm, log_steps=False)
    return {"apart: every rank refuses": raises(
                CheckpointError, lambda: _resolve_latest(apart, ctx.comm, log_steps=False),
                "found different checkpoints", "steps [-1, 4]"),
            "together: step 4": equal(resolved.train.resume_from,
                                      str(step_dir(shared() / "latest_a", 4)))}


@suite.case
def w2_ranks_that_resumed_different_steps_all_fail(ctx):
    """Ranks whose launchers resolved ``latest`` apart (another run saving meanwhile) resume
    different steps: rank 0 step 4, rank 1 step 6. Over the real exchange every rank raises,
    naming both steps; where both resume step 4 they go on, each knowing what the job read
    (every rank's bytes) and how long its slowest rank took."""
    import dataclasses
    from gradpool.app.checkpoints import run_extra
    from gradpool.app.rank_main import _resume
    from hyper_parallel.checkpoint.steps import step_dir
    cfg, model, optimizer = build(FLAT)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=8))
    root = shared() / "resumed_apart"
    for step in (4, 6):
        checkpoint.save(step_dir(root, step), model, optimizer, step=step,
                        extra=run_extra(cfg, ctx.world_size))

    def resuming(step: int):
        return dataclasses.replace(cfg, train=dataclasses.replace(
            cfg.train, resume_from=str(step_dir(root, step))))
    apart = raises(CheckpointError,
                   lambda: _resume(resuming(4 + 2 * ctx.rank), model, optimizer, ctx.comm),
                   "the ranks resumed from different steps [4, 6]",
                   f"this one from {step_dir(root, 4 + 2 * ctx.rank)}")
    resumed = _resume(resuming(4), model, optimizer, ctx.comm)
    mine = shared() / f"resumed_apart_rank{ctx.rank}.json"
    mine.write_text(json.dumps([resumed["bytes_read"], resumed["seconds"]]))
    _barrier(ctx)
    every = [json.loads((shared() / f"resumed_apart_rank{r}.json").read_text())
             for r in range(ctx.world_size)]
    return {"apart: every rank refuses": apart,
            "together: step 4": equal(resumed["step"], 4),
            "job bytes read: every rank's": equal(resumed["job_bytes_read"],
                                                 sum(b for b, _ in every)),
            "bytes read by each rank": equal(all(b > 0 for b, _ in every), True),
            "job seconds: the slowest rank's": equal(
                resumed["job_seconds"], max(float(np.float32(s)) for _, s in every))}


def _barrier(ctx: Context) -> None:
    buf = ms.Tensor(np.zeros(1, np.float32))
    ctx.comm.all_reduce(buf).wait()
    buf.asnumpy()


# -- phase 2: 4 ranks ---------------------------------------------------------------------------
def _load_dump_save(ctx, mesh, source: str, tag: str, *, seed: int, step: int,
                    save_as: str = None) -> dict:
    """Load ``source`` into a model built from another seed, dump what it holds as ``tag``;
    then (``save_as``) train one step and save and dump that too."""
    _, model, optimizer = build(mesh, seed=seed)
    loaded = checkpoint.load(shared() / source, model, optimizer)
    dump(tag, ctx, model, optimizer)
    if save_as:
        cfg = from_dict({}, MODEL + mesh)
        train(cfg, model, optimizer, ctx, steps=1)      # new values, saved and checked
        checkpoint.save(shared() / save_as, model, optimizer, step=3)
        dump(save_as, ctx, model, optimizer)
    return {"step": equal(loaded["step"], step)}


@suite.case
def w4_load_w2_flat_then_save(ctx):
    return _load_dump_save(ctx, FLAT, "w2", "w2_at_f4", seed=41, step=2, save_as="f4")


@suite.case
def w4_load_w2_hsdp_then_save(ctx):
    return _load_dump_save(ctx, HSDP, "w2", "w2_at_h4", seed=42, step=2, save_as="h4")


@suite.case
def w4_load_hsdp_into_flat(ctx):
    return _load_dump_save(ctx, FLAT, "h4", "h4_at_f4", seed=43, step=3)


@suite.case
def w4_hsdp_replicas_write_once(ctx):
    index = json.loads((shared() / "h4" / "index.json").read_text())
    files_with_model = sorted({p["file"].split("/")[-1] for k, r in index["tensors"].items()
                               if k.startswith("model/layers.0.attn.q") for p in r["pieces"]})
    return {"one_piece_per_shard": equal(files_with_model,
                                         ["rank-00000.safetensors", "rank-00001.safetensors"])}


@suite.case
def w4_ep2_save_and_full_state_dict(ctx):
    """EP 2 at 4 ranks: train, save "e2", dump; the full state dicts hold every expert (each
    from the ranks holding it), the same on every rank: written for the pytest side."""
    cfg, model, optimizer = build(EP2)
    train(cfg, model, optimizer, ctx, steps=2)
    checkpoint.save(shared() / "e2", model, optimizer, step=2)
    dump("e2", ctx, model, optimizer)
    full = {"model/" + k: v for k, v in get_model_state_dict(model, full_state_dict=True).items()}
    full.update({"optimizer/" + k: v for k, v in
                 get_optimizer_state_dict(model, optimizer, full_state_dict=True).items()})
    target = shared() / "full" / "e2"
    target.mkdir(parents=True, exist_ok=True)
    np.savez(target / f"rank{ctx.rank}.npz",
             **{k: v.astype(ms.float32).asnumpy() for k, v in full.items()})
    local = [p.name for p in model.trainable_params() if ".moe.experts." in p.name]
    experts = sorted({k.split(".moe.experts.")[1].split(".")[0] for k in full
                      if k.startswith("model/layers.0.moe.experts.")})
    return {"local experts only": equal(len(local), 2 * 2 * 3),    # 2 layers x 2 experts x 3
            "every expert in the full dict": equal(experts, ["0", "1", "2", "3"])}


@suite.case
def w4_ep2_full_state_dict_loads_into_ep4(ctx):
    """set_model_state_dict takes a full dict holding every expert: each rank keeps its own."""
    _, source, _ = build(EP2)
    full = get_model_state_dict(source, full_state_dict=True)
    _, model, _ = build(EP4, seed=5)
    set_model_state_dict(model, full)
    mine = {p.name: p for p in model.trainable_params()}
    gathered = get_model_state_dict(model, full_state_dict=True)
    same = all(np.array_equal(gathered[k].asnumpy(), v.asnumpy()) for k, v in full.items())
    return {"round trip": equal(same, True), "some local experts": equal(
        any(".moe.experts." in name for name in mine), True)}


@suite.case
def w4_load_ep2_at_ep4(ctx):
    return _load_dump_save(ctx, EP4, "e2", "e2_at_ep4", seed=51, step=2)


@suite.case
def w4_load_ep2_at_ep1(ctx):
    return _load_dump_save(ctx, EP1, "e2", "e2_at_ep1", seed=52, step=2)


# -- phase 3: 2 ranks again -------------------------------------------------------------------
@suite.case
def back_load_ep2_at_2_ranks_ep2(ctx):
    return _load_dump_save(ctx, EP2_AT_2, "e2", "e2_at_w2ep2", seed=53, step=2)


@suite.case
def back_load_ep2_at_2_ranks_ep1(ctx):
    return _load_dump_save(ctx, EP1_AT_2, "e2", "e2_at_w2ep1", seed=54, step=2)


@suite.case
def back_load_hsdp_at_2(ctx):
    return _load_dump_save(ctx, FLAT, "h4", "h4_at_w2", seed=45, step=3)


@suite.case
def back_load_world_1_at_2(ctx):
    return _load_dump_save(ctx, FLAT, "w1", "w1_at_w2", seed=47, step=5)


if __name__ == "__main__":
    suite.main()
