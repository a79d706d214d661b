"""A weight read outside its unit, in evaluation and in training, and ``reshard()`` (run by
tests/test_patterns.py at world size 1 and in the 2-rank pattern launch of
tests/test_patterns_distributed.py: its cases join pattern_cases.py's suite).

The model is a tied language-model head: a table ``embed.w`` of V = 7 rows (odd: at 2 ranks
each shard has 4 rows, one padded) maps inputs to a hidden state, a layer transforms it, and the
root computes the logits with the same table, ``h @ embed.w.T``. A read of the local shard
there would not fail: it would silently give 4 logits instead of 7. Each case compares the
logits of a forward without gradients (evaluation) and the gradients of training steps with the
same model unsharded, for a root with no parameters of its own and for one with a bias.
"""
from __future__ import annotations

import numpy as np

import mindspore as ms
from mindspore import Parameter, mint, nn, ops

from gradpool import GradPoolConfig
from harness import Suite, allclose, equal
from hyper_parallel import fully_shard
from hyper_parallel.core.fully_shard import MixedPrecisionPolicy
from npref import np_local

VOCAB, HIDDEN, ROWS, STEPS, LR = 7, 6, 3, 2, 0.3
TOL = 2e-6        # relative to the largest magnitude: the same sums in another order, float32


class Table(nn.Cell):
    def __init__(self, rng):
        super().__init__()
        self.w = Parameter(ms.Tensor((rng.standard_normal((VOCAB, HIDDEN)) * .5)
                                     .astype(np.float32)), name="embed.w")

    def construct(self, x):                  # x: (rows, VOCAB) soft token weights
        return mint.tanh(mint.matmul(x, self.w))


class Layer(nn.Cell):
    def __init__(self, rng):
        super().__init__()
        self.w = Parameter(ms.Tensor((rng.standard_normal((HIDDEN, HIDDEN)) * .5)
                                     .astype(np.float32)), name="layer.w")

    def construct(self, h):
        return mint.tanh(mint.matmul(h, self.w))


class TiedLM(nn.Cell):
    def __init__(self, root_bias: bool):
        super().__init__()
        rng = np.random.default_rng(11)
        self.embed = Table(rng)
        self.layer = Layer(rng)
        self.bias = Parameter(ms.Tensor(rng.standard_normal(VOCAB).astype(np.float32)),
                              name="bias") if root_bias else None

    def construct(self, x):
        logits = mint.matmul(self.layer(self.embed(x)), self.embed.w.T)   # the tied head
        return logits if self.bias is None else logits + self.bias


def _loss(model, x):
    logits = model(x)
    return (logits * logits).mean()


def _batch(step: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(300 + step).standard_normal((ROWS * world, VOCAB))
    x = x.astype(np.float32)
    return x[rank * ROWS:(rank + 1) * ROWS], x


def _sharded(root_bias: bool, mode: str) -> TiedLM:
    model = TiedLM(root_bias)
    mp = MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=mode != "plain")
    config = GradPoolConfig(poison_on_release=True, verify_gradients=True,
                            async_reduce=mode == "main_async")
    for child in (model.embed, model.layer):
        fully_shard(child, mp_policy=mp, pool_config=config)
    return fully_shard(model, mp_policy=mp, pool_config=config)


def _close(actual, expected) -> dict:
    scale = float(np.abs(expected).max(initial=0.0)) or 1.0
    return allclose(actual, expected, rtol=0.0, atol=TOL * scale)


def tied_head_case(ctx, root_bias: bool, mode: str, divide_factor: float = 0.0) -> dict:
    """Evaluation logits before and after training, and every training step's gradients, of
    the tied head against the unsharded model; then ``reshard()`` leaves nothing gathered.
    ``divide_factor``: ``set_gradient_divide_factor`` (each reduce sums, then divides by it),
    so the gradients are the unsharded model's (a mean over the global batch) x W / factor."""
    rank, world = ctx.rank, ctx.world_size
    model, ref = _sharded(root_bias, mode), TiedLM(root_bias)
    scale = world / divide_factor if divide_factor else 1.0
    if divide_factor:
        model.set_gradient_divide_factor(divide_factor)
    params, ref_params = model.trainable_params(), ref.trainable_params()
    checks = {}

    def evaluate(label: str, step: int) -> None:
        local, whole = _batch(step, rank, world)
        want = ref(ms.Tensor(whole)).asnumpy()[rank * ROWS:(rank + 1) * ROWS]
        got = model(ms.Tensor(local))              # no value_and_grad: no gradient recorded
        checks[f"{label}: evaluation logits"] = _close(got, want)

    evaluate("before training", 10)
    grad_fn = ms.value_and_grad(lambda x: _loss(model, x), None, params)
    ref_fn = ms.value_and_grad(lambda x: _loss(ref, x), None, ref_params)
    for step in range(STEPS):
        local, whole = _batch(step, rank, world)
        model.zero_grad()
        _, grads = grad_fn(ms.Tensor(local))
        _, ref_grads = ref_fn(ms.Tensor(whole))
        ref_grads = [g * scale for g in ref_grads]
        got = list(grads) if mode == "plain" else [p.main_grad for p in params]
        for param, grad, want in zip(params, got, ref_grads):
            checks[f"step {step} {param.name}"] = _close(
                grad, np_local(param.hsdp_param, want.asnumpy()))
        for param, grad in zip(params, got):
            ops.assign(param, param - LR * grad)
        for param, grad in zip(ref_params, ref_grads):
            ops.assign(param, param - LR * grad)
    evaluate("after training", 11)
    model.reshard()
    units = model._hsdp_units()                    # pylint: disable=protected-access
    # poison_on_release keeps released memory (NaN-filled): released is "no valid buffer"
    checks["a gathered buffer still valid after reshard()"] = equal(
        [b.shape for u in units for b in u.buffers if b is not None and b.valid], [])
    return checks


class Wide(nn.Cell):
    """One 2049 x 2048 float32 weight (16 MiB gathered, odd rows: uneven shards)."""

    def __init__(self):
        super().__init__()
        self.w = Parameter(ms.Tensor(np.ones((2049, 2048), np.float32)), name="wide.w")

    def construct(self, x):
        return mint.matmul(x, self.w)


def reshard_frees_case(ctx) -> dict:
    """``unshard()`` then ``reshard()``, and an evaluation pass then ``reshard()``: the unit's
    gathered bytes go to 0 and every gathered buffer's storage is released (0 bytes: the memory
    is back with MindSpore's allocator). Not RSS: on CPU MindSpore's allocator keeps the freed
    pages for its next allocations (RSS stays flat after a release, measured), so only the
    storage shows the release here."""
    model = Wide()
    fully_shard(model, pool_config=GradPoolConfig())
    unit = model._hsdp_units()[0]                  # pylint: disable=protected-access
    gathered = 2049 * 2048 * 4 if ctx.world_size > 1 else 0   # world 1: the shard is the full
    checks = {}
    for how in ("unshard", "evaluation"):
        if how == "unshard":
            model.unshard()
        else:       # a root keeps its parameters after forward (its backward follows at once)
            model(ms.Tensor(np.ones((1, 2049), np.float32)))
        held = unit.gathered_bytes
        model.reshard()
        checks[f"{how}: gathered bytes held, then after reshard()"] = equal(
            (held, unit.gathered_bytes), (gathered, 0))
        checks[f"{how}: storage bytes of the gathered buffers after reshard()"] = equal(
            [b.tensor.untyped_storage().size() for b in unit.buffers if b is not None],
            [0] * (ctx.world_size > 1))
        checks[f"{how}: the cell reads the local shard again"] = equal(
            "w" in model.__dict__, False)
    return checks


def add_to(suite: Suite, modes) -> None:
    for root_bias in (False, True):
        for mode in modes:
            suite.add(f"tied_head_root_{'with' if root_bias else 'without'}_params_{mode}",
                      lambda ctx, b=root_bias, m=mode: tied_head_case(ctx, b, m))
    for mode in modes:     # 3 does not divide the world: a wrong factor shows at 1 and 2 ranks
        suite.add(f"gradient_divide_factor_3_{mode}",
                  lambda ctx, m=mode: tied_head_case(ctx, True, m, divide_factor=3.0))
    suite.add("reshard_frees_the_gathered_memory", reshard_frees_case)
