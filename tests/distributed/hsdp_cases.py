"""HSDP cases on 4 msrun ranks (tests/test_hsdp_distributed.py): mesh (2, 2) = 2 replicas of
2-way shards, against the unsharded single-process model trained on the same global batch
(``train_reference``), per element.

Every training case runs with ``poison_on_release`` and ``verify_gradients``. Tolerances are
relative to each tensor's largest magnitude: another summation order than the reference's (the
shard-group then replicate-group reduction), measured below 1e-6 for float32.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gradpool.app.config import from_dict
from gradpool.app.model import TinyDeepSeekV3, next_token_loss
from gradpool.app.train import (_batch, build_sharded_model, gathered_params, train_reference,
                                train_sharded)
from gradpool.runtime import runtime_for
import collective_counts
from harness import Context, Suite, allclose, equal, late_communicators
from reshard_checks import reshard_checks
from hyper_parallel import clip_grad_norm_, fully_shard, init_device_mesh
from hyper_parallel.core.dtensor.placement_types import Shard

suite = Suite("hsdp", blocking_launch=True)
STEPS = 2
HSDP = ["fully_shard.reduce_dtype=float32", "fully_shard.apply_grad_on_fp32_main_grad=true",
        "fully_shard.mesh_shape=[2, 2]", "fully_shard.mesh_dim_names=[dp_replicate, fsdp]",
        "gradpool.poison_on_release=true", "gradpool.verify_gradients=true",
        f"train.steps={STEPS}", "launch.ranks=4"]
REPLICATED = "layers.0.attn_norm.weight"
SHARD_DIM_1 = "layers.1.attn.q"
PARAM_TOL = 5e-6        # x the tensor's largest magnitude
LOSS_RTOL = 1e-5


def _close(actual: np.ndarray, expected: np.ndarray, tol: float = PARAM_TOL) -> dict:
    scale = float(np.abs(expected).max()) or 1.0
    return allclose(actual, expected, rtol=0.0, atol=tol * scale)


def train_against_reference(ctx: Context, overrides, replicate=None, placement=None,
                            late: bool = False) -> dict:
    """``late``: every collective (both groups) runs when waited on, 20 ms after launch at the
    earliest; with the asynchronous reduce each non-root unit's backward must return with its
    reduce still pending."""
    cfg = from_dict({}, HSDP + list(overrides))
    with late_communicators() if late else contextlib.nullcontext([]) as made:
        model = build_sharded_model(cfg, replicate=replicate, shard_placement_fn=placement)
        runtime = runtime_for(cfg.gradpool)
        records = train_sharded(cfg, model, runtime.comm, runtime.pool)
    ref_losses, ref_params = train_reference(cfg, world=ctx.world_size)
    got = gathered_params(model)
    checks = {"losses": allclose(np.array([r.loss for r in records]), np.array(ref_losses),
                                 rtol=LOSS_RTOL, atol=0.0),
              "no allocation after step 1": equal([r.new_allocations for r in records[1:]],
                                                  [0] * (STEPS - 1))}
    for name, want in ref_params.items():
        checks[f"param {name}"] = _close(got[name], want)
    initial = {p.name: p.asnumpy() for p in TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
               .trainable_params()}
    moved = max(float(np.abs(got[name] - value).max()) for name, value in initial.items())
    checks["parameters really moved"] = equal(moved > 100 * PARAM_TOL, True)
    managed = [p.hsdp_param for p in model.trainable_params()]
    checks["sharded 2 ways, not 4"] = equal(
        sorted({m.world_size for m in managed if not m.replicate}), [2])
    checks["every gradient verified"] = equal(
        min(m.verified_gradients for m in managed) >= STEPS, True)
    units = [u for u in model._hsdp_units() if not u.is_root]   # pylint: disable=protected-access
    asynchronous = cfg.gradpool.async_reduce and cfg.fully_shard.apply_grad_on_fp32_main_grad
    checks["asynchronous reduce (main_grad mode) launched and finished in every unit"] = equal(
        sorted({(u.async_stats.launched > 0, u.async_stats.launched == u.async_stats.finished)
                for u in units}), [(asynchronous, True)])
    if late:
        checks["late collectives, both groups"] = equal(
            sorted({c.launches > 0 for c in made}) + [len(made) >= 3], [True, True])
        checks["non-root backwards returned with their reduce in flight"] = equal(
            sorted({u.async_stats.returned_in_flight == u.async_stats.launched for u in units}),
            [True])
    return checks


def _mesh_case(name, overrides, **kwargs):
    suite.add(name, lambda ctx: train_against_reference(ctx, overrides, **kwargs))


_mesh_case("hsdp_tiny_fused", ["fully_shard.comm_fusion=true"])
_mesh_case("hsdp_tiny_no_main_grad", ["fully_shard.apply_grad_on_fp32_main_grad=false",
                                       "fully_shard.comm_fusion=true"])
_mesh_case("hsdp_tiny_replicate_and_shard_dim_1", ["fully_shard.comm_fusion=true"],
           replicate=lambda model: [p for p in model.trainable_params() if p.name == REPLICATED],
           placement=lambda p: Shard(1) if p.name == SHARD_DIM_1 else None)
_mesh_case("hsdp_tiny_accumulate_all_reduce_last_micro_step",
           ["train.micro_steps=3", "fully_shard.all_reduce_every_micro_step=false",
            "fully_shard.comm_fusion=true"])
_mesh_case("hsdp_tiny_accumulate_no_sync_micro_steps_late", ["train.micro_steps=2",
                                                              "fully_shard.comm_fusion=true"],
           late=True)
_mesh_case("hsdp_tiny_per_gradient_late", [], late=True)
_mesh_case("hsdp_tiny_sum_scaled_by_one_quarter_sgd",
           ["fully_shard.reduce_op=sum", "fully_shard.gradient_scaling_factor=0.25",
            "train.optimizer=sgd", "train.learning_rate=0.5", "fully_shard.comm_fusion=true"])
# reshard_after_forward is the default in every case above (checked against the reference);
# these check it bit-identical to keeping the gathered parameters, on the (2, 2) mesh
suite.add("hsdp_reshard_after_forward_fused",
          lambda ctx: reshard_checks(HSDP, ["fully_shard.comm_fusion=true"]))
suite.add("hsdp_reshard_after_forward_per_gradient_sync",
          lambda ctx: reshard_checks(HSDP, ["gradpool.async_reduce=false"]))
_mesh_case("hsdp_tiny_sgd_avg_synchronous", ["train.optimizer=sgd", "train.learning_rate=0.5",
                                             "fully_shard.comm_fusion=true",
                                             "gradpool.async_reduce=false"])


@suite.case
def mesh_api(ctx: Context) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    rank = ctx.rank
    fsdp, dp = mesh["fsdp"], mesh["dp_replicate"]
    runtime = runtime_for(from_dict({}, HSDP).gradpool)
    total = ms.Tensor(np.array([float(rank)], np.float32))
    runtime.group_comm(mesh.get_group("fsdp")).all_reduce(total, op="sum").wait()
    return {
        "shape": equal([mesh.size(), mesh.ndim, list(mesh.mesh_dim_names)],
                       [4, 2, ["dp_replicate", "fsdp"]]),
        "local ranks": equal([mesh.get_local_rank("dp_replicate"), mesh.get_local_rank(1)],
                             [rank // 2, rank % 2]),
        "fsdp sub-mesh": equal(list(fsdp.ranks), [2 * (rank // 2), 2 * (rank // 2) + 1]),
        "replicate sub-mesh": equal(list(dp.ranks), [rank % 2, rank % 2 + 2]),
        "both dims": equal(list(mesh[("dp_replicate", "fsdp")].ranks), [0, 1, 2, 3]),
        "a collective in the fsdp group sums its two ranks":
            allclose(total, np.array([2.0 * (rank // 2) * 2 + 1.0]), rtol=0, atol=0),
    }


# -- a small MLP, dense and expert parameters on different meshes --------------------------------
class Weight(nn.Cell):
    def __init__(self, name, values):
        super().__init__()
        self.weight = Parameter(ms.Tensor(values), name=name)

    def construct(self, x):
        return mint.matmul(x, self.weight.T)


class MLP(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(7)
        self.dense = Weight("dense", rng.standard_normal((7, 6)).astype(np.float32))
        self.expert = Weight("expert", rng.standard_normal((5, 7)).astype(np.float32))

    def construct(self, x):
        return self.expert(mint.tanh(self.dense(x)))


@suite.case
def mlp_dense_on_a_1d_mesh_experts_on_hsdp(ctx: Context) -> dict:
    """Dense weights sharded 4 ways (a 1-D mesh over every rank), expert weights HSDP (2, 2):
    one model, two meshes, against the unsharded MLP trained on the global batch."""
    reference, net = MLP(), MLP()
    pool_config = from_dict({}, HSDP).gradpool
    fully_shard(net.expert, mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "fsdp")),
                pool_config=pool_config)
    fully_shard(net, mesh=init_device_mesh("cpu", (4,)), pool_config=pool_config)
    data = np.random.default_rng(11).standard_normal((8, 6)).astype(np.float32)
    mine = data[2 * ctx.rank:2 * ctx.rank + 2]
    for _ in range(3):
        for model, x in ((reference, data), (net, mine)):
            params = model.trainable_params()
            _, grads = ms.value_and_grad(lambda x: (model(x) ** 2).mean(), None,
                                         params)(ms.Tensor(x))
            nn.SGD(params, learning_rate=0.3)(grads)
    checks = {}
    for cell in ("dense", "expert"):
        param = getattr(net, cell).trainable_params()[0]
        got = param.hsdp_param.unsharded(param).asnumpy()
        want = getattr(reference, cell).weight.asnumpy()
        checks[f"{cell} equals the reference"] = _close(got, want)
        checks[f"{cell} moved"] = equal(
            float(np.abs(got - getattr(MLP(), cell).weight.asnumpy()).max()) > 1e-3, True)
    checks["dense sharded 4 ways, expert 2 ways"] = equal(
        [net.dense.weight.hsdp_param.world_size, net.expert.weight.hsdp_param.world_size], [4, 2])
    return checks


# -- clip_grad_norm_ ---------------------------------------------------------------------------
@suite.case
def clip_grad_norm_counts_every_element_once(ctx: Context) -> dict:
    """The norm of the HSDP gradients (a replicated parameter included, uneven shards padded)
    equals the unsharded model's gradient norm on the global batch (upstream #735 counted the
    replicated gradient once per rank); clipping scales main_grad to max_norm."""
    cfg = from_dict({}, HSDP)
    model = build_sharded_model(
        cfg, replicate=lambda m: [p for p in m.trainable_params() if p.name == REPLICATED])
    params = model.trainable_params()
    runtime = runtime_for(cfg.gradpool)
    grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
    grad_fn(_batch(cfg, 0, 0, runtime.comm.rank, runtime.comm.world_size))
    ref_model = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
    ref_cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, batch_size=cfg.model.batch_size * ctx.world_size))
    _, ref_grads = ms.value_and_grad(lambda t: next_token_loss(ref_model, t), None,
                                     ref_model.trainable_params())(_batch(ref_cfg, 0, 0, 0, 1))
    ref = [g.asnumpy().astype(np.float64) for g in ref_grads]
    want2 = math.sqrt(sum(float((g ** 2).sum()) for g in ref))
    want_inf = max(float(np.abs(g).max()) for g in ref)
    norm_inf = float(clip_grad_norm_(params, 1e9, norm_type=math.inf).asnumpy())
    before = {p.name: p.main_grad.asnumpy().copy() for p in params}
    norm2 = float(clip_grad_norm_(params, want2 / 4).asnumpy())
    coef = (want2 / 4) / (norm2 + 1e-6)
    scaled = all(np.allclose(p.main_grad.asnumpy(), before[p.name] * coef, rtol=1e-6, atol=0)
                 for p in params)
    again = float(clip_grad_norm_(params, 1e9).asnumpy())
    return {"2-norm equals the unsharded one": allclose(np.array([norm2]), np.array([want2]),
                                                        rtol=1e-5, atol=0),
            "inf-norm equals the unsharded one": allclose(np.array([norm_inf]),
                                                          np.array([want_inf]), rtol=1e-6, atol=0),
            "main_grad scaled in place by max_norm / norm": equal(scaled, True),
            "after clipping the norm is max_norm": allclose(np.array([again]),
                                                            np.array([want2 / 4]), rtol=1e-5,
                                                            atol=0)}


# Collectives per step and rank against the plan and the design (collective_counts.py).
collective_counts.add_cases(suite, ("hsdp",))


if __name__ == "__main__":
    suite.main()
