"""mindformers' own gradient norm and clipping on ``fully_shard`` DTensors, on real msrun ranks
(tests/test_mindformers_norm_distributed.py): 2 ranks shard one way (1-D mesh, uneven shards),
4 ranks are HSDP (2, 2).

A small model (uneven dim 0s: 5 and 7 rows; one parameter kept whole with ``replicate_params``)
runs one backward in main_grad mode; then mindformers' ``_calculate_global_grad_norm``
(imported from the installed mindformers, unpatched, called as its Trainer calls it) must give
the norm of the unsharded model's gradient on the global batch, computed in NumPy, and leave
every ``main_grad`` equal to this rank's part of the clipped unsharded gradient.
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn, ops

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Context, Suite, allclose, equal
from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.dtensor.dtensor import DTensor
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.core.fully_shard.utils import MixedPrecisionPolicy

suite = Suite("mindformers_norm", blocking_launch=True)
ROWS_PER_RANK = 2
TOL = 2e-6            # x the largest magnitude: another summation order than NumPy's


def mindformers_trainer_utils():
    """``mindformers.pynative.trainer.utils``, imported as mindformers' Trainer imports it.

    Its package imports ``enable_mindspore_backward_compat`` from
    ``hyper_parallel.platform.mindspore.autograd_compat``; where that module does not exist yet
    a test-only stand-in (never called here) lets the package import."""
    os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                             "mindformers-output"))
    name = "hyper_parallel.platform.mindspore.autograd_compat"
    try:
        __import__(name)
    except ModuleNotFoundError:
        stand_in = types.ModuleType(name)

        def enable_mindspore_backward_compat():
            raise RuntimeError("test stand-in: the real autograd_compat module is not installed")

        stand_in.enable_mindspore_backward_compat = enable_mindspore_backward_compat
        sys.modules[name] = stand_in
    from mindformers.pynative.trainer import utils
    return utils


@contextlib.contextmanager
def cpu_kernel_stand_ins():
    """MindSpore 2.10 has no CPU kernel for ``mint.stack`` (StackExt), which mindformers' grad
    norm sums its per-tensor norms with: ``ops.stack`` stands in, in this harness only."""
    original = mint.stack
    mint.stack = lambda tensors, dim=0: ops.stack(tensors, axis=dim)
    try:
        yield
    finally:
        mint.stack = original


class Linear(nn.Cell):
    def __init__(self, name, values, bias=None):
        super().__init__()
        self.weight = Parameter(ms.Tensor(values), name=f"{name}.weight")
        self.bias = None if bias is None else Parameter(ms.Tensor(bias), name=f"{name}.bias")
        self.saw_dtensor = []     # what the forward computed with: a DTensor or a plain tensor

    def construct(self, x):
        self.saw_dtensor.append(isinstance(self.weight, DTensor))
        out = mint.matmul(x, self.weight.T)
        return out if self.bias is None else out + self.bias


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(3)
        self.scale = Parameter(ms.Tensor(rng.standard_normal(3).astype(np.float32)), name="scale")
        self.l1 = Linear("l1", rng.standard_normal((5, 3)).astype(np.float32),
                         rng.standard_normal(5).astype(np.float32))
        self.l2 = Linear("l2", rng.standard_normal((7, 5)).astype(np.float32))

    def construct(self, x):
        return (self.l2(mint.tanh(self.l1(x * self.scale))) ** 2).mean()


def _mesh(world: int):
    if world == 4:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))
    return init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))


def _reference_grads(data: np.ndarray) -> dict:
    """The unsharded model's gradients of the mean loss over the global batch."""
    net = Net()
    params = net.trainable_params()
    _, grads = ms.value_and_grad(net, None, params)(ms.Tensor(data))
    return {p.name: g.asnumpy().astype(np.float64) for p, g in zip(params, grads)}


def _local_part(full: np.ndarray, param) -> np.ndarray:
    """This rank's part of ``full`` laid out as ``param`` (padded with zeros to the shard)."""
    spec = param._dtensor_spec                  # pylint: disable=protected-access
    box = spec.local_box(spec.mesh.coordinates())
    local = np.zeros(spec.local_shape)
    local[tuple(slice(0, n) for n in box.lengths)] = full[box.slices()]
    return local


def _close(actual, expected) -> dict:
    scale = float(np.abs(expected).max()) or 1.0
    return allclose(actual, expected, rtol=0.0, atol=TOL * scale)


def _sharded_net(ctx: Context):
    mesh = _mesh(ctx.world_size)
    net = Net()
    policy = MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)
    fully_shard(net.l1, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy, replicate_params=[net.scale])
    return net, mesh


@suite.case
def grad_norm_and_clip_match_the_unsharded_model(ctx: Context) -> dict:
    utils = mindformers_trainer_utils()
    data = np.random.default_rng(5).standard_normal(
        (ROWS_PER_RANK * ctx.world_size, 3)).astype(np.float32)
    mine = data[ROWS_PER_RANK * ctx.rank:ROWS_PER_RANK * (ctx.rank + 1)]
    net, mesh = _sharded_net(ctx)
    params = net.trainable_params()
    ms.value_and_grad(net, None, params)(ms.Tensor(mine))      # main_grad mode: into main_grad
    reference = _reference_grads(data)
    true_norm = float(np.sqrt(sum(float((g ** 2).sum()) for g in reference.values())))
    max_norm = 0.5 * true_norm
    checks = {}
    for p in params:
        checks[f"main_grad {p.name} before clipping"] = _close(p.main_grad.asnumpy(),
                                                              _local_part(reference[p.name], p))
    # mindformers' Trainer: _calculate_global_grad_norm(params, enable_parallel, max_norm)
    with cpu_kernel_stand_ins():
        norm, grads = utils._calculate_global_grad_norm(    # pylint: disable=protected-access
            params, enable_parallel=True, max_norm=max_norm)
    checks["global norm equals the unsharded gradient's norm"] = allclose(
        np.array([float(norm.asnumpy())]), np.array([true_norm]), rtol=1e-6, atol=0.0)
    checks["the grads it used are the main_grads, as DTensors"] = equal(
        [g is p.main_grad and isinstance(g, DTensor) for g, p in zip(grads, params)],
        [True] * len(params))
    coef = max_norm / (true_norm + 1e-6)
    for p in params:
        want = reference[p.name] * coef
        checks[f"main_grad {p.name} clipped in place"] = _close(p.main_grad.asnumpy(),
                                                               _local_part(want, p))
        checks[f"main_grad {p.name} full_tensor() is the clipped whole gradient"] = _close(
            p.main_grad.full_tensor().asnumpy(), want)
    hsdp = ctx.world_size == 4
    sharded = (Replicate(), Shard(0)) if hsdp else (Shard(0),)
    replicated = (Replicate(),) * mesh.ndim
    checks["placements"] = equal(
        {p.name: [str(x) for x in p.placements] for p in params},
        {p.name: [str(x) for x in (replicated if p.name == "scale" else sharded)]
         for p in params})
    checks["mindformers' grad factor: the Replicate mesh dims' sizes"] = equal(
        {p.name: utils._get_grad_factor(p.main_grad) for p in params},  # pylint: disable=W0212
        {p.name: float(ctx.world_size if p.name == "scale" else (2 if hsdp else 1))
         for p in params})
    checks["the forward computed with plain gathered tensors"] = equal(
        sorted(set(net.l1.saw_dtensor + net.l2.saw_dtensor)), [False])
    return checks


@suite.case
def partial_to_replicate_is_the_sum(ctx: Context) -> dict:
    """mindformers' warm-up indexer path: ``DTensor.from_local(grad, mesh, [Partial()] * n)
    .redistribute(mesh, [Replicate()] * n)`` (its ``_maybe_sync_warmup_indexer_grad``, called
    as its grad norm calls it) sums the ranks' gradients; the input is unchanged."""
    utils = mindformers_trainer_utils()
    mesh = _mesh(ctx.world_size)
    values = [np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) - r
              for r in range(ctx.world_size)]
    grad = ms.Tensor(values[ctx.rank])
    param = Parameter(ms.Tensor(np.zeros((2, 3), np.float32)), name="indexer")
    param._warmup_grad_mesh = mesh                     # pylint: disable=protected-access
    summed = utils._maybe_sync_warmup_indexer_grad(param, grad)  # pylint: disable=W0212
    return {
        "sum over every rank": allclose(summed.to_local(), np.sum(values, axis=0), rtol=0,
                                        atol=1e-6),
        "replicated on every mesh dim": equal([str(p) for p in summed.placements],
                                              [str(Replicate())] * mesh.ndim),
        "input unchanged": allclose(grad, values[ctx.rank], rtol=0, atol=0),
        "Partial -> Shard is refused by name": _refused(
            lambda: DTensor.from_local(grad, mesh, [Partial()] * mesh.ndim).redistribute(
                mesh, [Shard(0)] * mesh.ndim)),
    }


@suite.case
def shard_and_replicate_redistribute(ctx: Context) -> dict:
    """Replicate -> Shard keeps this rank's padded chunk; Shard -> Replicate gathers it back."""
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    full = np.arange(15, dtype=np.float32).reshape(5, 3)
    whole = DTensor.from_local(ms.Tensor(full), mesh, [Replicate()])
    shard = whole.redistribute(mesh, [Shard(0)])
    chunk = -(-5 // ctx.world_size)
    padded = np.zeros((chunk * ctx.world_size, 3), np.float32)
    padded[:5] = full
    back = shard.redistribute(mesh, [Replicate()])
    return {"chunk": allclose(shard.to_local(), padded[ctx.rank * chunk:(ctx.rank + 1) * chunk],
                              rtol=0, atol=0),
            "global shape kept": equal(list(shard.shape), [5, 3]),
            "gathered back": allclose(back.to_local(), full, rtol=0, atol=0)}


@suite.case
def platform_create_group_reduces_among_its_ranks(ctx: Context) -> dict:
    """``get_platform().create_group(ranks)`` (mindformers' Muon asks for its groups this way)
    names a communication group of those ranks: a sum in it adds only theirs."""
    from mindspore.mint.distributed import all_reduce

    from hyper_parallel.platform import get_platform
    half = 2 if ctx.world_size == 4 else ctx.world_size
    mine = [r for r in range(ctx.world_size) if r // half == ctx.rank // half]
    group = get_platform().create_group(mine)
    total = ms.Tensor(np.array([10.0 ** ctx.rank], np.float32))
    all_reduce(total, op=ops.ReduceOp.SUM, group=group)
    return {"sum of the group's ranks only": allclose(
        total, np.array([sum(10.0 ** r for r in mine)]), rtol=0, atol=0)}


def _refused(fn) -> dict:
    from harness import raises
    return raises(__import__("gradpool").FeatureNotProvidedError, fn, "FSDP/HSDP/EP only")


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
