"""End-to-end fully_shard cases on every rank of one msrun launch (tests/test_fully_shard_distributed.py
at world size 2, tests/test_fully_shard_distributed_4.py runs some of them at world size 4).

Each case checks two things, per rank and per element:

* **Gradients** (a probe before training, on the initial parameters): the reduced shard
  gradients ``value_and_grad`` returns and the float32 ``main_grad``, after one synchronized
  backward, after a second one without ``zero_grad`` (``main_grad`` must be the sum), and after
  a no-sync micro-step followed by a synchronized one (gradient accumulation), against this
  rank's chunk of the unsharded reference's gradient.
* **Training** (``train.steps`` optimizer steps through ``gradpool.app.train.train_sharded``):
  the mean loss per step and the gathered parameters.

The reference is the unsharded model (one process, no gradpool), computed on every rank:

* ``EXACT``: the unsharded model's gradient on each rank's local batch (the same ops as the
  sharded rank runs on the same gathered parameters, so the same bits), packed, accumulated and
  reduced as the pool does (rounded to the reduce dtype, float32 sums in rank order, ``avg``
  divides by W; :mod:`npref`), then the same optimizer. Where the arithmetic is the same this is
  bit for bit; at W=4 the collective's summation order is its own, so the tolerance there is the
  measured one (:data:`GRAD_TOL`, :data:`PARAM_TOL`).
* ``GLOBAL``: the unsharded model on the whole global batch (``train_reference``): independent of
  how the reduce is emulated, it pins the meaning of ``avg`` (the mean over the global batch).

Every case runs with ``poison_on_release`` (a read of recycled memory turns values NaN) and
``verify_gradients`` (each gradient autograd hands to the reduce path is checksummed on arrival
and again after its reduce).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import mint, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: npref

from gradpool.app.config import from_dict
from gradpool.app.model import TinyDeepSeekV3, make_batch_np, next_token_loss
from gradpool.app.train import (NonFiniteLossError, build_sharded_model, gathered_params,
                                train_reference, train_sharded)
from gradpool.layout import GradSlot
from gradpool.runtime import runtime_for
import collective_counts
from harness import Context, Suite, allclose, equal, late_communicators, raises
from hyper_parallel.core.dtensor.placement_types import Shard
from npref import np_chunk, reduce_over_ranks, round_to, add_rounded
from reshard_checks import reshard_checks

suite = Suite("fully_shard", blocking_launch=True)
STEPS = 3
FIELD = ["fully_shard.reduce_dtype=float32", "fully_shard.apply_grad_on_fp32_main_grad=true",
         "fully_shard.comm_fusion=false", "gradpool.poison_on_release=true",
         "gradpool.verify_gradients=true", f"train.steps={STEPS}"]
REPLICATED = "layers.0.attn_norm.weight"
SHARD_DIM_1 = "layers.1.attn.q"
# Backward passes of the gradient probe (each verifies every gradient once).
PROBE_BACKWARDS = 4
# Measured: at W=1 and W=2 every comparison with EXACT is bit-exact (two-rank sums have one
# order); at W=4 the collective sums each chunk in its own order (rank 0's shard came out exact,
# the others' within 1.65e-7 of the tensor's largest magnitude; bfloat16 results exact). (rtol,
# atol as a fraction of the tensor's largest magnitude.)
GRAD_TOL = {1: (0.0, 0.0), 2: (0.0, 0.0), 4: (0.0, 5e-7)}      # W=4 measured: 1.65e-7
PARAM_TOL = {1: (0.0, 0.0), 2: (0.0, 0.0), 4: (0.0, 4e-7)}     # W=4 measured: 1.24e-7
LOSS_RTOL = {1: 0.0, 2: 0.0, 4: 2.5e-7}                         # W=4 measured: 0
# Against GLOBAL (another summation order over the batch rows), as a fraction of the tensor's
# largest magnitude: measured 3e-7 (W=2) and 4.1e-7 (W=4) for float32 gradients, 5.9e-7 (W=2)
# and 3.8e-7 (W=4) for the parameters after 3 Adam steps, 1e-7 relative for the losses.
# bfloat16: the emulated gradient is within 0.0077 (W=2) / 0.0071 (W=4) of the global gradient
# rounded to bfloat16 (just under one bfloat16 ulp, 2**-7).
GLOBAL_GRAD_TOL = 2e-6
GLOBAL_BF16_GRAD_TOL = 2 ** -6
GLOBAL_PARAM_TOL = 2e-6
GLOBAL_LOSS_RTOL = 5e-7
SGD_LR = 0.5


@dataclass(frozen=True)
class Math:
    """Everything that decides the numbers of a run (not how they are bucketed or fused)."""

    world: int
    reduce_dtype: str
    micro_steps: int
    optimizer: str
    learning_rate: float
    op: str = "avg"


def math_of(cfg, world: int, op: str = "avg") -> Math:
    return Math(world, cfg.fully_shard.reduce_dtype, cfg.train.micro_steps, cfg.train.optimizer,
                float(cfg.train.learning_rate), op)


# -- the unsharded reference ------------------------------------------------------------------
def _optimizer(math: Math, params):
    if math.optimizer == "adam":
        return nn.Adam(params, learning_rate=math.learning_rate)
    return nn.SGD(params, learning_rate=math.learning_rate)


class _Unsharded:
    """One unsharded model and its grad function."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.model = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
        self.params = self.model.trainable_params()
        self.names = [p.name for p in self.params]
        self._grad_fn = ms.value_and_grad(lambda t: next_token_loss(self.model, t), None,
                                          self.params)

    def grads(self, tokens: np.ndarray) -> tuple[np.float32, list[np.ndarray]]:
        loss, grads = self._grad_fn(ms.Tensor(tokens))
        return np.float32(loss.asnumpy()), [np.array(g.asnumpy(), np.float32) for g in grads]

    def every_rank(self, index: int, comm) -> list[tuple[np.float32, list[np.ndarray]]]:
        """Loss and gradients of every rank's local batch ``index``, rank by rank. Each rank runs
        the backward of its own batch and the results are all-gathered (a float32 all-gather is
        exact), so no rank repeats another's backward."""
        world = comm.world_size
        mine = self.grads(make_batch_np(self.cfg.model, index, comm.rank, world,
                                        seed=self.cfg.train.seed))
        return _all_ranks(comm, *mine)

    def global_grads(self, index: int, world: int) -> list[np.ndarray]:
        """Gradients of the mean loss over all ``world`` ranks' rows of batch ``index``."""
        rows = np.concatenate([make_batch_np(self.cfg.model, index, r, world,
                                             seed=self.cfg.train.seed) for r in range(world)])
        return self.grads(rows)[1]


def _all_ranks(comm, loss, grads) -> list[tuple[np.float32, list[np.ndarray]]]:
    if comm.world_size == 1:
        return [(loss, grads)]
    flat = np.concatenate([np.array([loss], np.float32)] + [g.reshape(-1) for g in grads])
    out = mint.zeros(flat.size * comm.world_size, dtype=ms.float32)
    comm.all_gather(out, ms.Tensor(flat), async_op=False).wait()
    rows = np.array(out.asnumpy(), np.float32).reshape(comm.world_size, flat.size)
    result = []
    for row in rows:
        parts, cursor = [], 1
        for grad in grads:
            parts.append(row[cursor:cursor + grad.size].reshape(grad.shape))
            cursor += grad.size
        result.append((np.float32(row[0]), parts))
    return result


def _cfg(math: Math, steps: int = STEPS):
    return from_dict({}, FIELD + [f"fully_shard.reduce_dtype={math.reduce_dtype}",
                                  f"train.micro_steps={math.micro_steps}", f"train.steps={steps}",
                                  f"train.optimizer={math.optimizer}",
                                  f"train.learning_rate={math.learning_rate}"])


def _accumulated(per_micro, dtype) -> list[np.ndarray]:
    """One rank's bucket after its micro-steps: packed (rounded), then each added, rounded once."""
    acc = [round_to(g, dtype) for g in per_micro[0]]
    for grads in per_micro[1:]:
        acc = [add_rounded(a, g, dtype) for a, g in zip(acc, grads)]
    return acc


def _reduced(per_rank, math: Math) -> list[np.ndarray]:
    """Per-rank buckets -> the reduced gradients (float32 values of the reduce dtype)."""
    return [reduce_over_ranks([bucket[i] for bucket in per_rank], math.reduce_dtype, math.op,
                              math.world) for i in range(len(per_rank[0]))]


@functools.lru_cache(maxsize=None)
def exact_training(math: Math, comm, steps: int = STEPS):
    """EXACT: (losses per step as the sharded run reports them, final parameters by name)."""
    assert comm.world_size == math.world
    ref = _Unsharded(_cfg(math, steps))
    optimizer = _optimizer(math, ref.params)
    losses = []
    for step in range(steps):
        # micro[m][r] = (loss, grads) of rank r's micro-step m
        micro = [ref.every_rank(step * math.micro_steps + m, comm) for m in range(math.micro_steps)]
        per_rank = [_accumulated([micro[m][r][1] for m in range(math.micro_steps)],
                                 math.reduce_dtype) for r in range(math.world)]
        optimizer(tuple(ms.Tensor(g) for g in _reduced(per_rank, math)))
        # train_sharded: each rank's mean micro-step loss, averaged over ranks in float32
        local = [np.mean(np.array([micro[m][r][0] for m in range(math.micro_steps)], np.float32))
                 for r in range(math.world)]
        losses.append(float(reduce_over_ranks([np.float32(l) for l in local], "float32", "avg",
                                              math.world)))
    return losses, {p.name: np.array(p.asnumpy(), np.float32) for p in ref.params}


@functools.lru_cache(maxsize=None)
def initial_params() -> dict:
    ref = _Unsharded(_cfg(Math(1, "float32", 1, "adam", 1e-3)))
    return {p.name: np.array(p.asnumpy(), np.float32) for p in ref.params}


def probe_reference(math: Math, comm) -> dict:
    # the probe runs on the initial parameters: no optimizer, no micro-step setting involved
    return _probe_reference(math.reduce_dtype, math.op, comm)


@functools.lru_cache(maxsize=None)
def _batch_grads(comm) -> tuple:
    """Every rank's gradients of batches 0 and 1 on the initial parameters, and GLOBAL's of 0."""
    ref = _Unsharded(_cfg(Math(comm.world_size, "float32", 1, "adam", 1e-3)))
    b0 = [g for _, g in ref.every_rank(0, comm)]
    b1 = [g for _, g in ref.every_rank(1, comm)]
    return ref.names, b0, b1, ref.global_grads(0, comm.world_size)


@functools.lru_cache(maxsize=None)
def _probe_reference(reduce_dtype: str, op: str, comm) -> dict:
    """EXACT gradients of the probe's backward passes on the initial parameters (full shapes):
    ``first`` (batch 0), ``second`` (batch 1), ``main_two_syncs`` (main_grad after both, float32
    sum), ``accumulated`` (batch 0 no-sync + batch 1, reduced once); ``global`` is GLOBAL's
    gradient of batch 0."""
    math = Math(comm.world_size, reduce_dtype, 1, "adam", 1e-3, op)
    names, b0, b1, glob = _batch_grads(comm)
    first = _reduced([_accumulated([g], math.reduce_dtype) for g in b0], math)
    second = _reduced([_accumulated([g], math.reduce_dtype) for g in b1], math)
    accumulated = _reduced([_accumulated([g0, g1], math.reduce_dtype) for g0, g1 in zip(b0, b1)],
                           math)
    return {"names": names,
            "first": dict(zip(names, first)), "second": dict(zip(names, second)),
            "main_two_syncs": dict(zip(names, [(a + b).astype(np.float32)
                                               for a, b in zip(first, second)])),
            "accumulated": dict(zip(names, accumulated)),
            "global": dict(zip(names, glob))}


# -- checks -----------------------------------------------------------------------------------
def _close(actual, expected, tol) -> dict:
    rtol, atol_frac = tol
    scale = float(np.abs(expected).max()) if np.size(expected) else 0.0
    return allclose(np.asarray(actual, np.float64), expected, rtol=rtol, atol=atol_frac * scale)


def _local(managed, full: np.ndarray, rank: int) -> np.ndarray:
    """This rank's piece of a full-shape reference: the whole tensor when replicated, else its
    chunk along the shard dim, zero-padded (the padding of a reduced shard must be 0)."""
    if managed.replicate:
        return full
    return np_chunk(full, managed.shard_dim, rank, managed.world_size)


def _copy(tensor) -> np.ndarray:
    return np.array(tensor.astype(ms.float32).asnumpy(), np.float64)


def probe_checks(ctx: Context, cfg, model) -> dict:
    """The gradient probe (see the module docstring); leaves the model zero-graded, untrained."""
    math = math_of(cfg, ctx.world_size, cfg.fully_shard.reduce_op)
    want = probe_reference(math, ctx.comm)
    tol = GRAD_TOL[ctx.world_size]
    params = model.trainable_params()
    managed = {p.name: p.hsdp_param for p in params}
    grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
    use_main = cfg.fully_shard.apply_grad_on_fp32_main_grad

    def backward(index: int, sync: bool):
        model.set_requires_gradient_sync(sync)
        tokens = ms.Tensor(make_batch_np(cfg.model, index, ctx.rank, ctx.world_size,
                                         seed=cfg.train.seed))
        _, grads = grad_fn(tokens)
        return {p.name: _copy(g) for p, g in zip(params, grads)}     # views: copy at once

    def main_grads():
        return {p.name: None if p.main_grad is None else _copy(p.main_grad) for p in params}

    def compare(label, got: dict, key: str, tolerance=tol) -> dict:
        out = {}
        for name in want["names"]:
            expected = _local(managed[name], want[key][name], ctx.rank)
            if got[name] is None:
                out[f"{label} {name}"] = equal(None, "a float32 array")
            else:
                out[f"{label} {name}"] = _close(got[name], expected, tolerance)
        return out

    # main_grad mode (asynchronous reduce or not): autograd gets zeros, main_grad the reduce
    asynchronous = use_main

    def returned(label, got: dict, key: str) -> dict:
        if asynchronous:
            return {f"{label}: zeros (main_grad mode)": equal(
                all(not np.any(v) for v in got.values()), True)}
        return compare(label, got, key)

    checks = {"probe covers every parameter": equal(sorted(managed), sorted(want["names"]))}
    model.zero_grad()
    checks.update(returned("step-1 reduced shard grad", backward(0, True), "first"))
    if use_main:
        checks.update(compare("main_grad after 1 backward", main_grads(), "first"))
    second = backward(1, True)                  # no zero_grad: main_grad must add
    checks.update(returned("2nd-backward reduced shard grad", second, "second"))
    if use_main:
        checks.update(compare("main_grad after 2 synced backwards", main_grads(),
                              "main_two_syncs"))
    model.zero_grad()
    if use_main:
        zeroed = main_grads()
        checks["zero_grad makes main_grad zeros of the shard's shape"] = equal(
            {name: (None if g is None else [list(g.shape), float(np.abs(g).max(initial=0.0))])
             for name, g in zeroed.items()},
            {name: [list(managed[name].local_shape), 0.0] for name in zeroed})
    no_sync = backward(0, False)
    checks["no-sync micro-step returns zero grads"] = equal(
        all(not np.any(v) for v in no_sync.values()), True)
    checks.update(returned("accumulated (2 micro-steps) reduced shard grad", backward(1, True),
                           "accumulated"))
    if use_main:
        checks.update(compare("main_grad after 2 micro-steps", main_grads(), "accumulated"))
    model.set_requires_gradient_sync(True)
    model.zero_grad()
    # The emulation itself against the plain global-batch gradient (it must mean the same thing);
    # bfloat16: within two bfloat16 ulps of the global gradient rounded to bfloat16.
    for name in want["names"]:
        glob = want["global"][name]
        if math.reduce_dtype == "bfloat16":
            check = _close(want["first"][name], round_to(glob, "bfloat16"),
                           (0.0, GLOBAL_BF16_GRAD_TOL))
        else:
            check = _close(want["first"][name], glob, (0.0, GLOBAL_GRAD_TOL))
        checks[f"reference matches global-batch gradient {name}"] = check
    return checks


def run_case(ctx: Context, overrides: list, global_reference: bool = False, **build):
    """Probe, then train ``cfg.train.steps`` steps; checks against EXACT (and GLOBAL)."""
    cfg = from_dict({}, FIELD + overrides)
    model = build_sharded_model(cfg, **build)
    runtime = runtime_for(cfg.gradpool)
    checks = probe_checks(ctx, cfg, model)
    try:
        records = train_sharded(cfg, model, runtime.comm, runtime.pool)
    except NonFiniteLossError as exc:     # report it with the probe's checks, which say why
        checks["training losses finite"] = equal(str(exc), None)
        return checks, model, cfg, None
    math = math_of(cfg, ctx.world_size, cfg.fully_shard.reduce_op)
    exact_losses, exact_params = exact_training(math, ctx.comm, cfg.train.steps)
    got = gathered_params(model)
    losses = np.array([r.loss for r in records])
    rtol, atol_frac = PARAM_TOL[ctx.world_size]
    checks["losses vs exact reference"] = allclose(losses, exact_losses,
                                                   rtol=LOSS_RTOL[ctx.world_size], atol=0)
    for name, want in exact_params.items():
        checks[f"param {name} vs exact reference"] = _close(got[name], want, (rtol, atol_frac))
    if global_reference:
        ref_losses, ref_params = global_training(cfg.train.micro_steps, ctx.world_size,
                                                 cfg.train.optimizer, cfg.train.learning_rate)
        checks["losses vs global-batch reference"] = allclose(losses, ref_losses,
                                                              rtol=GLOBAL_LOSS_RTOL, atol=0)
        for name, want in ref_params.items():
            checks[f"param {name} vs global-batch reference"] = _close(
                got[name], want, (0.0, GLOBAL_PARAM_TOL))
    managed = [p.hsdp_param for p in model.trainable_params()]
    steps = cfg.train.steps * cfg.train.micro_steps
    checks["every gradient verified intact"] = equal(
        sorted({p.verified_gradients for p in managed}), [PROBE_BACKWARDS + steps])
    checks["no new allocations after step 1"] = equal([r.new_allocations for r in records[1:]],
                                                      [0] * (cfg.train.steps - 1))
    checks["sharded along the group"] = equal(
        all(p.replicate or p.sharded_param.shape[p.shard_dim] == -(-p.orig_shape[p.shard_dim]
                                                                    // ctx.world_size)
            for p in managed), True)
    checks["shards are the slot's chunk shape"] = equal(
        all(p.replicate or tuple(p.sharded_param.shape)
            == GradSlot.of(p.orig_shape, ctx.world_size, p.shard_dim).chunk_shape
            for p in managed), True)
    if cfg.fully_shard.apply_grad_on_fp32_main_grad:
        checks["main_grad is float32"] = equal(
            sorted({str(p.sharded_param.main_grad.dtype) for p in managed}), ["Float32"])
    return checks, model, cfg, records


@functools.lru_cache(maxsize=None)
def global_training(micro_steps: int, world: int, optimizer: str = "adam",
                    learning_rate: float = 1e-3):
    cfg = from_dict({}, FIELD + [f"train.micro_steps={micro_steps}",
                                 f"train.optimizer={optimizer}",
                                 f"train.learning_rate={learning_rate}"])
    return train_reference(cfg, world)


def moved_checks(got: dict, tolerance: float) -> dict:
    """The training moved the parameters far (100x) beyond ``tolerance``: a comparison at that
    tolerance could not pass with untrained or half-trained parameters."""
    start = initial_params()
    moved = np.concatenate([np.abs(got[n] - start[n]).reshape(-1) for n in start])
    return {f"parameters moved >> tolerance {tolerance:.2g} (median |change| > 100x)": equal(
        bool(np.median(moved) > 100 * tolerance), True)}


# -- cases ------------------------------------------------------------------------------------
@suite.case
def field_configuration(ctx: Context) -> dict:
    """reduce float32 == grad float32, fp32 main_grad, comm_fusion off: the crash in the field.
    Also against the plain global-batch training (GLOBAL)."""
    return run_case(ctx, [], global_reference=True)[0]


@suite.case
def comm_fusion_on(ctx: Context) -> dict:
    return run_case(ctx, ["fully_shard.comm_fusion=true"])[0]


@suite.case
def reduce_in_bfloat16(ctx: Context) -> dict:
    """bfloat16 reduce: against EXACT, whose gradients are each rank's rounded to bfloat16,
    summed in float32, averaged and rounded to bfloat16 again; per element."""
    checks, model, cfg, records = run_case(ctx, ["fully_shard.reduce_dtype=bfloat16"],
                                           global_reference=False)
    if records is None:
        return checks
    _, atol_frac = PARAM_TOL[ctx.world_size]
    got = gathered_params(model)
    exact_params = exact_training(math_of(cfg, ctx.world_size), ctx.comm, STEPS)[1]
    # the largest absolute tolerance any parameter was compared with (at least 1e-6)
    tolerance = max(atol_frac * float(np.abs(v).max()) for v in exact_params.values())
    checks.update(moved_checks(got, max(tolerance, 1e-6)))
    # bfloat16 really changed the numbers: float32 reduction would give other parameters
    f32_params = exact_training(math_of(from_dict({}, FIELD), ctx.world_size), ctx.comm, STEPS)[1]
    differs = [float(np.abs(got[n] - f32_params[n]).max()) for n in f32_params]
    checks["bfloat16 reduce differs from a float32 one"] = equal(max(differs) > 0, True)
    return checks


@suite.case
def two_micro_steps_synchronous(ctx: Context) -> dict:
    """Gradient accumulation with the synchronous reduce (``async_reduce`` off): each unit's
    reduce completes in its backward and lands in main_grad there (autograd gets zeros)."""
    return run_case(ctx, ["train.micro_steps=2", "gradpool.async_reduce=false"])[0]


@suite.case
def zero_copy(ctx: Context) -> dict:
    checks, model, _, _ = run_case(ctx, ["gradpool.zero_copy=true", "gradpool.alignment_bytes=4"])
    reducers = {id(p.hsdp_param.unit.reducer): p.hsdp_param.unit.reducer
                for p in model.trainable_params()}
    checks["some gradients were borrowed, not copied"] = equal(
        sum(r.borrows for r in reducers.values()) > 0, True)
    return checks


@suite.case
def replicate_and_shard_dim_1(ctx: Context) -> dict:
    checks, model, _, _ = run_case(
        ctx, [],
        replicate=lambda model: [p for p in model.trainable_params() if p.name == REPLICATED],
        shard_placement_fn=lambda p: Shard(1) if p.name == SHARD_DIM_1 else None)
    params = {p.name: p for p in model.trainable_params()}
    full = params[SHARD_DIM_1].hsdp_param.orig_shape
    checks["replicated parameter is whole"] = equal(
        [params[REPLICATED].hsdp_param.replicate, list(params[REPLICATED].shape)],
        [True, list(params[REPLICATED].hsdp_param.orig_shape)])
    checks["Shard(1) parameter is split on dim 1"] = equal(
        list(params[SHARD_DIM_1].shape), [full[0], -(-full[1] // ctx.world_size)])
    return checks


@suite.case
def sgd_losses_see_the_gradient_scale(ctx: Context) -> dict:
    """Plain SGD (Adam is invariant to a gradient's scale): a reduce that sums where it should
    average changes the losses, and this case shows by how much."""
    checks, _, cfg, records = run_case(ctx, ["train.optimizer=sgd",
                                             f"train.learning_rate={SGD_LR}"],
                                       global_reference=True)
    if records is None:
        return checks
    losses = np.array([r.loss for r in records])
    # "sum" over W ranks is W times the average: plain SGD at W times the learning rate
    scaled, _ = global_training(cfg.train.micro_steps, ctx.world_size, "sgd",
                                SGD_LR * ctx.world_size)
    tolerance = max(GLOBAL_LOSS_RTOL * float(np.abs(losses).max()), 1e-6)
    gap = float(np.abs(np.array(scaled) - losses)[1:].max()) if ctx.world_size > 1 else None
    checks["a summed reduce would change the losses >> tolerance"] = equal(
        gap is None or gap > 100 * tolerance, True)
    checks["losses fall"] = equal(bool(losses[-1] < losses[0]), True)
    return checks


def _late_case(ctx: Context, overrides: list) -> dict:
    """Every collective runs at wait() (it reads its input bucket then), 20 ms after launch at the
    earliest: an input bucket released without its fence and re-packed meanwhile is reduced with
    another gradient's values (or the pool's NaN poison), and the comparisons fail. With the
    asynchronous reduce (main_grad mode) each non-root unit's backward must return with its
    collectives still pending (none has run yet), and they land in main_grad at the root's end."""
    with late_communicators() as made:
        checks, model, _, _ = run_case(ctx, overrides)
    checks["collectives went through the late communicator"] = equal(
        bool(made) and made[0].launch_counts["reduce_scatter"] > 0, True)
    units = [u for u in model._hsdp_units() if not u.is_root]    # pylint: disable=protected-access
    checks["non-root units returned from backward with their reduce in flight, every time"] = \
        equal(sorted({(u.async_stats.launched > 0,
                       u.async_stats.returned_in_flight == u.async_stats.launched
                       == u.async_stats.finished) for u in units}), [(True, True)])
    return checks


@suite.case
def collectives_complete_late(ctx: Context) -> dict:
    return _late_case(ctx, ["gradpool.max_buckets_in_flight=null"])


@suite.case
def collectives_complete_late_fused_micro_steps(ctx: Context) -> dict:
    """The same with comm_fusion (small buckets: several per unit), two micro-steps and a bound
    of one bucket in flight (acquires wait for the oldest fence)."""
    return _late_case(ctx, ["fully_shard.comm_fusion=true", "gradpool.bucket_cap_mib=0.01",
                            "gradpool.max_buckets_in_flight=1", "train.micro_steps=2"])


@suite.case
def forward_prefetch_launches_the_next_units_gathers_first(ctx: Context) -> dict:
    """The root prefetches layer 0, layer 0 prefetches layer 1 (comm_fusion: one all-gather per
    unit): all three gathers are launched before layer 0's forward runs, none when the layers'
    forwards start, and the gradients are the reference's. Without prefetch each layer gathers
    when its own forward starts (the order the prefetch must change)."""
    want = probe_reference(Math(ctx.world_size, "float32", 1, "adam", 1e-3), ctx.comm)
    cfg = from_dict({}, FIELD + ["fully_shard.comm_fusion=true"])
    checks = {}
    for prefetch in (False, True):
        with late_communicators(delay_seconds=0.0) as made:
            model = build_sharded_model(cfg)
            log = made[0].launch_log
            if prefetch:
                model.set_modules_to_forward_prefetch([model.layers[0]])
                model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
            for index, layer in enumerate(model.layers):
                layer.register_forward_pre_hook(
                    lambda cell, inputs, index=index: log.append(f"forward layer {index}"))
            params = model.trainable_params()
            tokens = ms.Tensor(make_batch_np(cfg.model, 0, ctx.rank, ctx.world_size,
                                             seed=cfg.train.seed))
            ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)(tokens)
            forward = [name for name in log if name != "reduce_scatter"]
            forward = forward[:forward.index("forward layer 1") + 1]
            expected = (["all_gather"] * 3 + ["forward layer 0", "forward layer 1"] if prefetch
                        else ["all_gather", "all_gather", "forward layer 0", "all_gather",
                              "forward layer 1"])
            label = "with" if prefetch else "without"
            checks[f"all-gathers and forwards, {label} prefetch"] = equal(forward, expected)
            for param in params:
                checks[f"main_grad {param.name}, {label} prefetch"] = _close(
                    _copy(param.main_grad),
                    _local(param.hsdp_param, want["first"][param.name], ctx.rank),
                    GRAD_TOL[ctx.world_size])
    return checks


def _gather_log(ctx: Context, cfg, setup) -> tuple[list, object]:
    """One step of the tiny model through a recording communicator: every collective's name in
    launch order, with ``gather <unit>`` when a unit gathers (forward) or gathers again
    (backward pre-hook), ``backward <unit>`` when its backward starts and ``loss`` between."""
    with late_communicators(delay_seconds=0.0) as made:
        model = build_sharded_model(cfg)
        setup(model)
        log = made[0].launch_log
        names = {id(model.__dict__["_hsdp_state"]): "root"}
        names.update({id(layer.__dict__["_hsdp_state"]): f"layer{i}"
                      for i, layer in enumerate(model.layers)})
        for unit in model._hsdp_units():     # pylint: disable=protected-access
            label = names[id(unit)]
            unit.memory.gather = _logged(log, f"gather {label}", unit.memory.gather)
            unit.steps.on_backward = _logged(log, f"backward {label}", unit.steps.on_backward)
        params = model.trainable_params()
        tokens = ms.Tensor(make_batch_np(cfg.model, 0, ctx.rank, ctx.world_size,
                                         seed=cfg.train.seed))

        def loss_fn(t):
            loss = next_token_loss(model, t)
            log.append("loss")
            return loss
        ms.value_and_grad(loss_fn, None, params)(tokens)
    return [entry for entry in log if entry != "reduce_scatter"], model


def _logged(log: list, entry: str, fn):
    def logged(*args):
        log.append(entry)
        return fn(*args)
    return logged


@suite.case
def backward_prefetch_gathers_the_next_unit_while_this_one_computes(ctx: Context) -> dict:
    """The order of all-gathers (comm_fusion: one per unit) in forward and backward, from a
    recording communicator. Forward: each layer gathers at its own forward. Backward with
    reshard_after_forward: the root keeps its parameters and, when its backward starts,
    launches layer 1's gather (the next unit in backward order); layer 1 gathers again by
    waiting on it and launches layer 0's; layer 0 launches nothing. set_modules_to_backward_
    prefetch([]) turns it off (each layer launches its own gather when its backward starts) and
    a list overrides it; reshard_after_forward=False gathers nothing in backward;
    set_reshard_after_backward(False) keeps what backward gathered."""
    base = FIELD + ["fully_shard.comm_fusion=true", "gradpool.poison_on_release=false"]
    forward = ["gather root", "all_gather", "gather layer0", "all_gather", "gather layer1",
               "all_gather", "loss"]

    def no_prefetch(model):
        for unit_module in [model, *model.layers]:
            unit_module.set_modules_to_backward_prefetch([])

    def root_prefetches_both(model):
        no_prefetch(model)
        model.set_modules_to_backward_prefetch([model.layers[1], model.layers[0]])

    def keep_after_backward(model):
        model.set_reshard_after_backward(False)

    expected = {
        "implicit": (base, lambda m: None, [
            "all_gather", "gather layer1", "all_gather", "backward layer1", "gather layer0",
            "backward layer0", "backward root"]),
        "off": (base, no_prefetch, [
            "gather layer1", "all_gather", "backward layer1", "gather layer0", "all_gather",
            "backward layer0", "backward root"]),
        "root prefetches both": (base, root_prefetches_both, [
            "all_gather", "all_gather", "gather layer1", "backward layer1", "gather layer0",
            "backward layer0", "backward root"]),
        "reshard_after_forward false": (
            base + ["fully_shard.reshard_after_forward=false"], lambda m: None,
            ["backward layer1", "backward layer0", "backward root"]),
        "reshard_after_backward false": (base, keep_after_backward, [
            "all_gather", "gather layer1", "all_gather", "backward layer1", "gather layer0",
            "backward layer0", "backward root"]),
    }
    checks = {}
    for label, (overrides, setup, backward) in expected.items():
        cfg = from_dict({}, overrides)
        log, model = _gather_log(ctx, cfg, setup)
        checks[f"{label}: gathers in forward"] = equal(log[:log.index("loss") + 1], forward)
        checks[f"{label}: gathers in backward"] = equal(log[log.index("loss") + 1:], backward)
        units = [u for u in model._hsdp_units() if not u.is_root]   # pylint: disable=protected-access
        kept = label == "reshard_after_backward false"
        checks[f"{label}: gathered memory after the step"] = equal(
            [u.gathered_bytes > 0 for u in units], [kept] * len(units))
    return checks


class _LazyNet(nn.Cell):
    """Parameters of every kind of initializer, with uneven dim-0 shards at W = 2 and 4."""

    def __init__(self):
        from mindspore import Parameter
        from mindspore.common.initializer import Constant, Normal, initializer
        super().__init__()
        self.const = Parameter(initializer(Constant(0.5), (7, 6), ms.float32), name="const")
        self.normal = Parameter(initializer(Normal(0.02), (301, 64), ms.float32), name="normal")
        self.dense = nn.Dense(64, 33)           # HeUniform weight, Uniform bias (MindSpore's)
        self.wide = Parameter(initializer(Normal(1.0), (40, 51), ms.float32), name="wide")

    def construct(self, x):
        return self.dense(x).sum() + self.const.sum() + self.normal.sum() + self.wide.sum()


@suite.case
def lazy_init_materialises_only_the_local_shard(ctx: Context) -> dict:
    """A model built under no_init_parameters(): fully_shard draws each rank's shard only (every
    initializer call has the shard's shape, no full parameter is ever materialised), a constant
    init equals the unsharded parameter's slice, a random one has its distribution, differs
    between ranks, repeats for the same seed, and the padding is zero; the model then trains."""
    from mindspore.common.initializer import Initializer
    from mindspore.nn.utils import no_init_parameters
    from hyper_parallel import fully_shard
    calls = []
    original_call, original_init_data = Initializer.__call__, ms.Tensor.init_data

    def recording_call(self, arr):
        calls.append((type(self).__name__, tuple(arr.shape)))
        return original_call(self, arr)

    def refusing_init_data(self, *args, **kwargs):
        calls.append(("init_data", tuple(self.shape)))
        return original_init_data(self, *args, **kwargs)

    def build():
        with no_init_parameters():
            net = _LazyNet()
        Initializer.__call__, ms.Tensor.init_data = recording_call, refusing_init_data
        try:
            fully_shard(net, pool_config=from_dict({}, FIELD).gradpool)
        finally:
            Initializer.__call__, ms.Tensor.init_data = original_call, original_init_data
        return net

    net = build()
    params = {p.name: p for p in net.trainable_params()}
    managed = {name: p.hsdp_param for name, p in params.items()}
    world, rank = ctx.world_size, ctx.rank
    real = {name: tuple(m.slot.valid_length(rank) if d == 0 else n
                        for d, n in enumerate(m.orig_shape)) for name, m in managed.items()}
    checks = {"no init_data of a whole parameter": equal(
        [c for c in calls if c[0] == "init_data"], [])}
    checks["every initializer call had this rank's real shard shape"] = equal(
        sorted(shape for _, shape in calls), sorted(real.values()))
    checks["local shards have the chunk shape"] = equal(
        {n: tuple(p.shape) for n, p in params.items()},
        {n: m.slot.chunk_shape for n, m in managed.items()})
    const = params["const"].asnumpy()
    checks["constant init equals the unsharded slice (padding zero)"] = equal(
        bool(np.array_equal(const, np_chunk(np.full((7, 6), 0.5, np.float32), 0, rank, world))),
        True)
    normal = params["normal"].asnumpy()
    rows = managed["normal"].slot.valid_length(rank)
    drawn = normal[:rows]
    checks["Normal(0.02): mean ~ 0, std within 5 % of 0.02"] = equal(
        bool(abs(drawn.mean()) < 0.002 and abs(drawn.std() / 0.02 - 1) < 0.05), True)
    checks["padding rows are zero"] = equal(bool(not np.any(normal[rows:])), True)
    full = gathered_params(net)["normal"]
    halves = [full[r * managed["normal"].slot.chunk_size:][:16] for r in range(world)]
    checks["ranks draw different values"] = equal(
        all(not np.array_equal(halves[0], h) for h in halves[1:]), True)
    weight = params["dense.weight"].asnumpy()[:managed["dense.weight"].slot.valid_length(rank)]
    bound = 1 / np.sqrt(64)      # HeUniform(a=sqrt(5)), fan_in 64: MindSpore's Dense default
    checks["Dense weight within its HeUniform bound"] = equal(
        bool(np.abs(weight).max() <= bound and np.abs(weight).max() > 0.8 * bound), True)
    again = {p.name: p.asnumpy() for p in build().trainable_params()}
    checks["the same seed draws the same shard"] = equal(
        all(np.array_equal(again[n], p.asnumpy()) for n, p in params.items()), True)
    x = ms.Tensor(np.ones((2, 64), np.float32))
    loss, grads = ms.value_and_grad(net, None, net.trainable_params())(x)
    checks["the lazily built model runs forward and backward"] = equal(
        bool(np.isfinite(float(loss.asnumpy()))) and len(grads) == len(params), True)
    return checks


@suite.case
def poison_makes_a_read_of_released_gather_memory_fail_loudly(ctx: Context) -> dict:
    """With poison_on_release, released gathered parameters hold NaN (their memory kept), and a
    backward that would read them before their gather again (the backward pre-hook's gather
    switched off here) raises LeaseStateError naming the unit, instead of reading stale bytes."""
    from gradpool import LeaseStateError
    cfg = from_dict({}, FIELD + ["fully_shard.comm_fusion=true"])       # poison on (FIELD)
    model = build_sharded_model(cfg)
    layer = model.layers[1].__dict__["_hsdp_state"]
    tokens = ms.Tensor(make_batch_np(cfg.model, 0, ctx.rank, ctx.world_size,
                                     seed=cfg.train.seed))
    seen = {}

    def loss_fn(t):
        loss = next_token_loss(model, t)
        seen["nan"] = [bool(np.isnan(b.tensor.asnumpy()).all()) for b in layer.buffers if b]
        return loss

    layer.memory.needs_gather = lambda: False     # the re-gather before backward is skipped
    grad_fn = ms.value_and_grad(loss_fn, None, model.trainable_params())
    checks = {"the step raises LeaseStateError naming the released parameter": raises(
        LeaseStateError, lambda: grad_fn(tokens), "released after forward", "DecoderLayer")}
    checks["released buffers held NaN when the loss was computed"] = equal(
        bool(seen["nan"]) and all(seen["nan"]), True)
    del layer.memory.needs_gather
    model.zero_grad()
    grad_fn(tokens)                               # with the re-gather, the same model steps
    checks["the next step, gathered again, has finite main_grad"] = equal(
        all(np.isfinite(p.main_grad.asnumpy()).all() for p in model.trainable_params()), True)
    return checks


# -- reshard_after_forward: freed after forward, gathered again before backward -----------------
def _list_unit_model(cfg, **_):
    """The tiny model with its two decoder layers as ONE unit (fully_shard([layer0, layer1]))."""
    from hyper_parallel import fully_shard
    from gradpool.app.train import mixed_precision
    model = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
    kwargs = dict(mp_policy=mixed_precision(cfg), comm_fusion=cfg.fully_shard.comm_fusion,
                  reshard_after_forward=cfg.fully_shard.reshard_after_forward,
                  pool_config=cfg.gradpool)
    fully_shard(list(model.layers), **kwargs)
    return fully_shard(model, **kwargs)


def _forward_prefetch(model) -> None:
    model.set_modules_to_forward_prefetch([model.layers[0]])
    model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])


RESHARD_VARIANTS = {
    "per_gradient_async": ([], {}, None),
    "fused": (["fully_shard.comm_fusion=true"], {}, None),
    "sync_reduce": (["gradpool.async_reduce=false"], {}, None),
    "no_main_grad": (["fully_shard.apply_grad_on_fp32_main_grad=false"], {}, None),
    "no_sync_micro_steps_fused": (["train.micro_steps=2", "fully_shard.comm_fusion=true"], {}, None),
    "forward_prefetch": (["fully_shard.comm_fusion=true"], {}, _forward_prefetch),
    "replicated_and_shard_dim_1": ([], dict(
        replicate=lambda model: [p for p in model.trainable_params() if p.name == REPLICATED],
        shard_placement_fn=lambda p: Shard(1) if p.name == SHARD_DIM_1 else None), None),
}


def _reshard_case(name, overrides, build, prepare):
    suite.add(f"reshard_after_forward_{name}",
              lambda ctx: reshard_checks(FIELD, ["train.steps=2"] + overrides, build, prepare))


for _name, (_overrides, _build, _prepare) in RESHARD_VARIANTS.items():
    _reshard_case(_name, _overrides, _build, _prepare)


@suite.case
def reshard_after_forward_mixed_precision_fp16(ctx: Context) -> dict:
    """param_dtype=float16: the gathered buffers, released and regrown, are float16."""
    models = []
    checks = reshard_checks(FIELD, ["train.steps=2", "fully_shard.param_dtype=float16",
                                    "fully_shard.comm_fusion=true"], prepare=models.append)
    dtypes = {str(b.dtype) for model in models
              for u in model._hsdp_units()  # pylint: disable=protected-access
              for b in u.buffers if b is not None}
    checks["gathered in float16, in both runs"] = equal((len(models), sorted(dtypes)),
                                                        (2, ["Float16"]))
    return checks


@suite.case
def reshard_after_forward_list_unit(ctx: Context) -> dict:
    return reshard_checks(FIELD, ["train.steps=2", "fully_shard.comm_fusion=true"],
                          builder=_list_unit_model)


@suite.case
def gathers_straight_into_the_buffers(ctx: Context) -> dict:
    """A parameter gathered alone whose gathered rows are its full tensor (dim 0 divisible by the
    world, float32 compute) is all-gathered into its buffer, the others through a temporary;
    values as with resharding off. The one parameter per unit that carries the unit-order tag
    (its smallest gathered one) is gathered with the tag through a temporary."""
    import hyper_parallel.platform.mindspore.fully_shard.param as param_module
    import hyper_parallel.platform.mindspore.fully_shard.unit_memory as memory_module
    launched, in_unit = {}, []
    launch_all, launch_one = memory_module.launch_all_gather, param_module._launch_one_gather

    def unit_gather(*args, buffers=None, **kwargs):     # a unit's gather (it passes buffers)
        in_unit.append(buffers is not None)
        try:
            return launch_all(*args, buffers=buffers, **kwargs)
        finally:
            in_unit.pop()

    def recording(param, local, into=None, tag=None):
        if in_unit and in_unit[-1]:
            launched.setdefault(param.name, set()).add((into is not None, tag is not None))
        return launch_one(param, local, into, tag=tag)

    memory_module.launch_all_gather, param_module._launch_one_gather = unit_gather, recording
    models = []
    try:
        checks = reshard_checks(FIELD, ["train.steps=1"], prepare=models.append)
    finally:
        memory_module.launch_all_gather, param_module._launch_one_gather = launch_all, launch_one
    shapes = {p.name: tuple(p.hsdp_param.orig_shape) for p in models[0].trainable_params()}
    carriers = set()
    for unit in models[0]._hsdp_units():           # pylint: disable=protected-access
        gathered = [p for p in unit.params if not p.replicate and p.world_size > 1]
        if gathered:
            carriers.add(min(gathered, key=lambda p: p.slot.chunk_numel).name)
    got = {name: sorted(flags) for name, flags in launched.items()}
    expected = {name: [(shapes[name][0] % ctx.world_size == 0 and name not in carriers,
                        name in carriers)] for name in launched}
    checks["straight into the buffer exactly when the rows are the tensor, tag aside"] = equal(
        got, expected)
    checks["both kinds present"] = equal(
        sorted({into for flags in launched.values() for into, _ in flags}), [False, True])
    return checks


# Collectives per step and rank against the plan and the design (collective_counts.py).
collective_counts.add_cases(suite, ("fsdp", "ep"))


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
