"""Expert parallelism (tests/test_moe_distributed.py) on 2 msrun ranks: the tiny model with
``model.expert_parallel = 2`` (each rank two of the four experts, sparse, all-gather dispatcher,
each layer's experts a unit on the expert-data-parallel sub-mesh, divide factor W) against the
E=1 model unsharded in one process on the global batch: every gradient at every step, the losses
and every parameter after 3 SGD steps; the rows each rank's experts compute against the
reference's routing; the divide factor's guard and its bad values. The all-to-all dispatcher
(its CPU stand-in exchange) the same way and against the all-gather dispatcher trained beside
it, with a routing that sends no token to EP rank 1; and the stand-in exchange itself.

Tolerance (``TOL``): float32 values whose only difference from the reference is summation
order: the dispatcher's reduce-scatter adds the EP ranks' partial outputs (a row's two expert
terms, added in the same expert order as the dense sum: exact here), the gradients of the
gathered tokens are summed over the EP ranks and the reduces over the data-parallel ranks, each
in another order than the reference's one matmul over the global batch. Each is a few float32
ulps (2^-24 ~ 6e-8 relative) of the largest term, so a gradient is compared within
``TOL * max|reference gradient|`` per parameter (TOL = 2e-6: ~30 ulps), as the other suites
do, and a parameter after 3 steps of SGD with learning rate ``LR`` within ``TOL * max|param|``.
A wrong expert divide factor (E times too large) is off by 100% and fails it
(``wrong_divide_factor_is_caught``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import mindspore as ms
import numpy as np
from mindspore import ops

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: npref

from gradpool import InvalidArgumentError, runtime_for
from gradpool.app.config import from_dict
from gradpool.app.model import TinyDeepSeekV3, global_batch_np, make_batch_np, next_token_loss
from gradpool.app.train import build_sharded_model, gathered_params
from harness import Suite, allclose, equal, raises
from npref import np_local

suite = Suite("moe", blocking_launch=True)
STEPS = 3
LR = 0.5
TOL = 2e-6
# expert_hidden 23 (odd): an expert's down [23, 32] shards unevenly over 2 EDP ranks;
# vocab 67: embed and head shard unevenly everywhere.
BASE = ["model.expert_hidden=23", "model.batch_size=2", "fully_shard.reduce_dtype=float32",
        "gradpool.verify_gradients=true", "gradpool.poison_on_release=true"]
MODES = {"plain": ["fully_shard.apply_grad_on_fp32_main_grad=false"],
         "main_async": ["fully_shard.apply_grad_on_fp32_main_grad=true",
                        "gradpool.async_reduce=true"],
         "main_sync": ["fully_shard.apply_grad_on_fp32_main_grad=true",
                       "gradpool.async_reduce=false"]}


@dataclass(frozen=True)
class Run:
    ep: int
    mode: str = "plain"
    mesh: tuple = ()             # () : FSDP over every rank; (R, S): HSDP
    experts: int = 4
    top_k: int = 2
    wrong_factor: bool = False   # leave the experts' default ("avg" over the EDP ranks)
    dispatcher: str = "all-gather"
    starve: Optional[int] = None  # this EP rank's experts get no token (selection bias)


def config(run: Run, world: int):
    overrides = BASE + MODES[run.mode] + [
        f"launch.ranks={world}", f"model.expert_parallel={run.ep}",
        f"model.num_experts={run.experts}", f"model.experts_per_token={run.top_k}",
        f"model.moe_dispatcher={run.dispatcher}"]
    if run.mesh:
        overrides += [f"fully_shard.mesh_shape={list(run.mesh)}",
                      "fully_shard.mesh_dim_names=[dp_replicate, fsdp]"]
    return from_dict({}, overrides)


def _sgd(params, grads) -> None:
    for param, grad in zip(params, grads):
        ops.assign(param, param - LR * grad)


def _close(got, want) -> dict:
    want = np.asarray(want, np.float32)
    scale = float(np.abs(want).max(initial=0.0)) or 1.0
    return allclose(got, want, rtol=0.0, atol=TOL * scale)


def starve(model, run: Run) -> None:
    """Route no token to EP rank ``run.starve``'s experts, in every MoE layer of ``model``: a
    selection bias far below any logit on them (the weights, and so the values, stay the
    softmax of the chosen logits; the reference gets the same bias)."""
    if run.starve is None:
        return
    per_rank = run.experts // run.ep
    bias = np.zeros(run.experts, np.float32)
    bias[run.starve * per_rank:(run.starve + 1) * per_rank] = -1e4
    for layer in model.layers:
        layer.moe.selection_bias = ms.Tensor(bias)


def _starved_checks(ctx, run: Run, model, step: int) -> dict:
    """On a starved rank, its experts ran on the padding row only (no row routed to them)."""
    if run.starve is None or ctx.rank % run.ep != run.starve:
        return {}
    return {f"step {step} layer {i} starved: no row, padding only": equal(
        (layer.moe.experts.last.routed, layer.moe.experts.last.padding),
        (0, run.experts // run.ep)) for i, layer in enumerate(model.layers)}


def train_and_compare(ctx, run: Run) -> dict:
    """Train the EP model against the E=1 reference (every gradient, the losses, every
    parameter after the steps); with the all-to-all dispatcher, also against the same EP model
    with the all-gather dispatcher, trained beside it."""
    cfg = config(run, ctx.world_size)
    model = build_sharded_model(cfg)
    twin = (build_sharded_model(config(replace(run, dispatcher="all-gather"), ctx.world_size))
            if run.dispatcher == "all-to-all" else None)
    if run.wrong_factor:
        for layer in model.layers:
            layer.moe.experts.set_reduce_op_type("avg")
    ref = TinyDeepSeekV3(replace(cfg.model, expert_parallel=1), seed=cfg.train.seed)
    for net in (model, twin, ref):
        if net is not None:
            starve(net, run)
    params = model.trainable_params()
    twin_params = twin.trainable_params() if twin is not None else []
    ref_by_name = {p.name: p for p in ref.trainable_params()}
    ref_params = [ref_by_name[p.name] for p in params]    # the experts this rank holds
    others = [p for p in ref.trainable_params() if p.name not in {q.name for q in params}]
    grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
    twin_fn = (ms.value_and_grad(lambda t: next_token_loss(twin, t), None, twin_params)
               if twin is not None else None)
    ref_fn = ms.value_and_grad(lambda t: next_token_loss(ref, t), None,
                               ref_params + others)
    checks, losses, twin_losses, ref_losses = {}, [], [], []
    for step in range(STEPS):
        batch = ms.Tensor(make_batch_np(cfg.model, step, ctx.rank, ctx.world_size,
                                        seed=cfg.train.seed))
        model.zero_grad()
        loss, grads = grad_fn(batch)
        checks.update(_starved_checks(ctx, run, model, step))
        ref_loss, ref_grads = ref_fn(ms.Tensor(global_batch_np(cfg.model, step, ctx.world_size,
                                                               seed=cfg.train.seed)))
        got = [p.main_grad for p in params] if run.mode != "plain" else list(grads)
        for param, g, want in zip(params, got, ref_grads):
            checks[f"step {step} grad {param.name}"] = _close(
                g, np_local(param.hsdp_param, want.asnumpy()))
        losses.append(_mean_over_ranks(ctx, loss))
        ref_losses.append(float(ref_loss.asnumpy()))
        if twin is not None:
            twin.zero_grad()
            twin_loss, twin_grads = twin_fn(batch)
            twin_got = ([p.main_grad for p in twin_params] if run.mode != "plain"
                        else list(twin_grads))
            for param, g, want in zip(params, got, twin_got):
                checks[f"step {step} grad {param.name} = all-gather dispatcher's"] = _close(
                    g, want.asnumpy())
            twin_losses.append(_mean_over_ranks(ctx, twin_loss))
            _sgd(twin_params, twin_got)
        _sgd(params, got)
        _sgd(ref_params + others, ref_grads)
    model.zero_grad()
    checks["losses"] = allclose(np.array(losses), np.array(ref_losses), rtol=TOL, atol=0.0)
    full = gathered_params(model)
    for name, value in full.items():
        checks[f"after {STEPS} steps {name}"] = _close(value, ref_by_name[name].asnumpy())
    if twin is not None:
        twin.zero_grad()
        checks["losses = all-gather dispatcher's"] = allclose(
            np.array(losses), np.array(twin_losses), rtol=TOL, atol=0.0)
        for name, value in gathered_params(twin).items():
            checks[f"after {STEPS} steps {name} = all-gather dispatcher's"] = _close(
                full[name], value)
    checks["pool holds no lease"] = equal(runtime_for(cfg.gradpool).pool.stats().live_leases, 0)
    return checks


def _mean_over_ranks(ctx, loss) -> float:
    buf = ms.Tensor(np.array([float(loss.asnumpy())], np.float32))
    ctx.comm.all_reduce(buf, op="avg").wait()
    return float(buf.asnumpy()[0])


def wrong_factor_caught(ctx, run: Run) -> dict:
    """The guard the divide factor is: with the experts' default ("avg" over the W/E EDP ranks)
    their gradients are E times the reference's and the comparison above fails."""
    checks = train_and_compare(ctx, replace(run, wrong_factor=True))
    expert_grads = {k: v for k, v in checks.items() if k.startswith("step 0 grad") and ".experts." in k}
    dense_grads = {k: v for k, v in checks.items() if k.startswith("step 0 grad")
                   and ".experts." not in k}
    return {"every expert gradient is off": equal(
                sorted(k for k, v in expert_grads.items() if v.get("mismatches", 0) == 0), []),
            "step 0 dense gradients still match": equal(
                sorted(k for k, v in dense_grads.items() if v.get("mismatches", 1) != 0), []),
            "some expert gradients compared": equal(len(expert_grads) > 0, True)}


def routed_rows_match_reference(ctx, run: Run) -> dict:
    """Each rank's experts run on exactly the rows the reference routes to them (counted from
    the E=1 model's routing weights on the global batch), and that is the whole expert work:
    k * E * N rows over the EP group, against num_experts * N per rank for the dense product."""
    cfg = config(run, ctx.world_size)
    model = build_sharded_model(cfg)
    ref = TinyDeepSeekV3(replace(cfg.model, expert_parallel=1), seed=cfg.train.seed)
    seen = []
    for layer in ref.layers:
        layer.moe.register_forward_pre_hook(
            lambda cell, args: seen.append(cell.routing_weights(
                args[0].reshape(-1, args[0].shape[-1])).asnumpy()))
    tokens_per_rank = cfg.model.batch_size * cfg.model.seq_len
    model(ms.Tensor(make_batch_np(cfg.model, 0, ctx.rank, ctx.world_size)[:, :-1]))
    ref(ms.Tensor(global_batch_np(cfg.model, 0, ctx.world_size)[:, :-1]))
    group = ctx.rank // run.ep
    rows = slice(group * run.ep * tokens_per_rank, (group + 1) * run.ep * tokens_per_rank)
    checks = {}
    for index, layer in enumerate(model.layers):
        work = layer.moe.experts.last
        want = {g: int(np.count_nonzero(seen[index][rows, g])) for g in layer.moe.experts.indices}
        checks[f"layer {index} rows per local expert"] = equal(work.rows, want)
        checks[f"layer {index} no padding row"] = equal(work.padding, 0)
        total = ms.Tensor(np.array([work.routed], np.float32))
        ctx.comm.all_reduce(total, op="sum").wait()
        checks[f"layer {index} rows over all ranks = k * W * N"] = equal(
            int(total.asnumpy()[0]), run.top_k * ctx.world_size * tokens_per_rank)
        # the dense E=1 product runs every expert on every token of the rank
        mean_rows = float(total.asnumpy()[0]) / ctx.world_size
        checks[f"layer {index} expert rows per rank fall by num_experts / k"] = equal(
            run.experts * tokens_per_rank / mean_rows, run.experts / run.top_k)
    return checks


def names_and_initial_values(ctx, run: Run) -> dict:
    """Global names, this EP rank's experts only, values of the E=1 model's same experts."""
    cfg = config(run, ctx.world_size)
    model = build_sharded_model(cfg)
    ref = {p.name: p.asnumpy() for p in TinyDeepSeekV3(replace(cfg.model, expert_parallel=1),
                                                        seed=cfg.train.seed).trainable_params()}
    full = gathered_params(model)
    per_rank = run.experts // run.ep
    mine = range((ctx.rank % run.ep) * per_rank, (ctx.rank % run.ep + 1) * per_rank)
    want = sorted(n for n in ref if ".experts." not in n
                  or int(n.split(".experts.")[1].split(".")[0]) in mine)
    checks = {"names": equal(sorted(full), want)}
    checks["values equal the E=1 model's"] = equal(
        sorted(n for n in full if not np.array_equal(full[n], ref[n])), [])
    units = {type(c).__name__ for _, c in model.cells_and_names() if "_hsdp_state" in c.__dict__}
    checks["the experts are units of their own"] = equal(
        sorted(u for u in units if "LocalExperts" in u), ["HSDPLocalExperts"])
    edp = model.layers[0].moe.experts.trainable_params()[0].hsdp_param.world_size
    checks["experts shard over W/E ranks"] = equal(edp, ctx.world_size // run.ep)
    return checks


def divide_factor_bad_values(ctx) -> dict:
    model = build_sharded_model(config(Run(ep=2), ctx.world_size))
    experts = model.layers[0].moe.experts
    checks = {}
    for bad in (0, -2.0, float("nan"), float("inf"), "2", True, None):
        checks[f"refused {bad!r}"] = raises(InvalidArgumentError,
                                            lambda: experts.set_gradient_divide_factor(bad),
                                            "gradient divide factor", repr(bad))
    experts.set_gradient_divide_factor(3)
    state = experts.__dict__["_hsdp_state"]
    checks["set"] = equal(
        (state.settings.gradient_divide_factor, state.reduce_path._wire_op()), (3.0, "sum"))
    experts.set_reduce_op_type("avg")
    checks["set_reduce_op_type replaces it"] = equal(
        (state.settings.gradient_divide_factor, state.reduce_path._wire_op()), (None, "avg"))
    return checks


def all_to_all_stand_in(ctx) -> dict:
    """The CPU stand-in for all_to_all_single (gradpool.app.moe_exchange) over the world group,
    against the blocks each rank addressed to this one (built here from the same rule): rank 0
    sends nothing (its input is one padding row), the last rank receives nothing (it gets one
    zero row); then the counts exchange, and a receive count that disagrees with the senders'
    split sizes, refused on every rank (which then exchange again, in step)."""
    from gradpool.app.moe_exchange import GatheredAllToAll
    from gradpool.errors import CommError
    world, me = ctx.world_size, ctx.rank

    def count(s, d):
        return 0 if s == 0 or d == world - 1 else (s + d) % 3 + 1

    def block(s, d):
        return np.array([[100 * s + 10 * d + j, -j, 0.5] for j in range(count(s, d))],
                        np.float32).reshape(-1, 3)

    exchange = GatheredAllToAll(ctx.comm)
    send = [count(me, d) for d in range(world)]
    receive = [count(s, me) for s in range(world)]
    x = np.concatenate([block(me, d) for d in range(world)] + [np.full((1, 3), 7, np.float32)])
    got = exchange.rows(ms.Tensor(x), send, receive)
    want = np.concatenate([block(s, me) for s in range(world)])
    checks = {"rows": allclose(got, want if want.size else np.zeros((1, 3)), rtol=0, atol=0)}
    table = np.array([[10 * me + d, d] for d in range(world)], np.int64)      # [destination, 2]
    checks["counts"] = equal(exchange.counts(table).tolist(),
                             [[10 * s + me, me] for s in range(world)])
    wrong = [c + (s == world - 1) for s, c in enumerate(receive)]
    checks["a disagreeing receive count is refused"] = raises(
        CommError, lambda: exchange.rows(ms.Tensor(x), send, wrong), "counts exchange",
        f"({world - 1}, ")
    # refused on every rank alike, so the ranks are still in step
    checks["rows again"] = allclose(exchange.rows(ms.Tensor(x), send, receive),
                                    want if want.size else np.zeros((1, 3)), rtol=0, atol=0)
    return checks


def add_cases(into: Suite, tag: str, run: Run, modes=tuple(MODES)) -> None:
    for mode in modes:
        into.add(f"{tag}_{mode}_matches_reference",
                 lambda ctx, r=replace(run, mode=mode): train_and_compare(ctx, r))


add_cases(suite, "ep2", Run(ep=2))
add_cases(suite, "ep2_all_to_all_rank1_starved", Run(ep=2, dispatcher="all-to-all", starve=1),
          ("main_async",))
suite.case(all_to_all_stand_in)
suite.add("ep2_wrong_divide_factor_is_caught", lambda ctx: wrong_factor_caught(ctx, Run(ep=2)))
suite.add("ep2_routed_rows_match_reference",
          lambda ctx: routed_rows_match_reference(ctx, Run(ep=2)))
suite.add("ep2_names_and_initial_values", lambda ctx: names_and_initial_values(ctx, Run(ep=2)))
suite.case(divide_factor_bad_values)


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
