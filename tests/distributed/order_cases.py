"""The unit-order check carried inside the units' own collectives (hyper_parallel/platform/
mindspore/fully_shard/order.py, order_flag.py), on 2 msrun ranks (tests/test_unit_order_
distributed.py; the 4-rank HSDP cases, built from these, are in pattern_cases_4.py).

* a rank that built and trained another sharded model first (its own 1-rank mesh) still trains
  the job's model exactly, against the unsharded model (unit identity is not a counter);
* units swapped on one rank (same sizes: the collectives complete, the shards would mix) are
  refused at the end of the backward on every rank, naming what each rank ran, the parameters
  untouched and the next step exact; a reduce carrying another kind's tag names the collective;
* the strict mode refuses a unit skipped on one rank before the collective that would hang;
* host reads (tests/host_reads.py): every call of ``asnumpy``, ``item``, ``tolist``,
  ``float(tensor)``, a device synchronize or a launch-queue drain made by gradpool or
  hyper_parallel code during a training step (forward, backward, the end of backward), per case
  and step: none but the CPU-only host path and the one read of the order flag per optimizer
  step (plain, main_grad, fused, recompute, micro-steps; expert parallelism 2); with
  ``clip_grad_norm_`` in the step still that one read, the clipped ``main_grad`` equal to
  NumPy's clipping of the unsharded model's gradients.

The model and its reference are tests/distributed/pattern_cases.py's (every dim odd: uneven
shards at 2 ranks).
"""
from __future__ import annotations

import sys
from pathlib import Path

import mindspore as ms
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: npref, host_reads

from gradpool import GradPoolConfig, UnsupportedPatternError
from harness import Suite, equal, raises
from host_reads import count_host_reads
from hyper_parallel import clip_grad_norm_, fully_shard
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.fully_shard import MixedPrecisionPolicy
from hyper_parallel.platform.mindspore.fully_shard.order import GATHER, REDUCE, tag_of
from hyper_parallel.platform.mindspore.fully_shard.runtime import RUNTIME
import pattern_cases as pc

suite = Suite("order", blocking_launch=True)


def _sharded(model, mode: str, config: GradPoolConfig, mesh=None, fused: bool = False):
    mp = MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=mode != "plain")
    extra = {} if mesh is None else {"mesh": mesh}
    for name in ("embed", "a", "b"):
        fully_shard(getattr(model, name), mp_policy=mp, pool_config=config, comm_fusion=fused,
                    **extra)
    fully_shard(model, mp_policy=mp, pool_config=config, comm_fusion=fused, **extra)
    return model


def _params_now(model) -> dict:
    return {p.name: p.asnumpy().copy() for p in model.trainable_params()}


# -- identity: another model built first on one rank -----------------------------------------------
@suite.case
def another_sharded_model_trained_first_on_rank_0(ctx) -> dict:
    """Rank 0 alone builds and trains a sharded copy of the model on a mesh of itself (an
    evaluation copy, a teacher): 4 more units registered there first. The job's model then trains
    exactly on both ranks, in every mode, against the unsharded model."""
    checks = {}
    if ctx.rank == 0:
        config = GradPoolConfig(poison_on_release=True)
        alone = _sharded(pc.Net(), "main_async", config,
                         mesh=DeviceMesh("cpu", (1,), ranks=(0,)))
        grad_fn = ms.value_and_grad(lambda x: pc.loss_of(alone, x), None,
                                    alone.trainable_params())
        for step in range(2):
            alone.zero_grad()
            grad_fn(ms.Tensor(pc._batch(step, 0, 1, pc.ROWS)[0]))   # pylint: disable=protected-access
    for mode in ("plain", "main_async"):
        got = pc.train_and_compare(ctx, pc.Run(mode=mode))
        checks.update({f"{mode}: {name}": check for name, check in got.items()})
    return checks


# -- the default check: swapped units ---------------------------------------------------------------
class SwapNet(pc.Net):
    """``a`` and ``b`` (both 7 -> 7: their collectives have the same sizes) run in the other order
    when ``swap`` is set."""

    swap = False

    def construct(self, x):
        h = self.embed(x)
        h = self.a(self.b(h)) if self.swap else self.b(self.a(h))
        return self.head(h)


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def swap_case(ctx, mode: str, fused: bool, check_unit_order=True, mesh=None) -> dict:
    """``a`` and ``b`` swapped on the last rank only: refused on every rank (with an HSDP
    ``mesh``, the ranks of the other shard group too), naming what each rank ran; the parameters
    untouched, ``main_grad`` dropped, and the next step exact against the unsharded model."""
    config = GradPoolConfig(poison_on_release=True, verify_gradients=True,
                            async_reduce=mode == "main_async", check_unit_order=check_unit_order)
    model = _sharded(SwapNet(), mode, config, fused=fused, mesh=mesh)
    ref = SwapNet()
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda x: pc.loss_of(model, x), None, params)
    ref_fn = ms.value_and_grad(lambda x: pc.loss_of(ref, x), None, ref.trainable_params())
    local, whole = pc._batch(0, ctx.rank, ctx.world_size, pc.ROWS)   # pylint: disable=protected-access
    checks = {}
    before = _params_now(model)
    model.zero_grad()
    model.swap = ctx.rank == ctx.world_size - 1
    checks["swapped on the last rank: refused on every rank"] = raises(
        UnsupportedPatternError, lambda: grad_fn(ms.Tensor(local)), "different order",
        f"{_ranks(list(range(ctx.world_size - 1)))} at the all-gather of unit 'a' (Lin)",
        f"rank {ctx.world_size - 1} at the all-gather of unit 'b' (Lin)")
    model.swap = False
    checks["parameters untouched"] = equal(
        {k: bool(np.array_equal(v, before[k])) for k, v in _params_now(model).items()},
        {k: True for k in before})
    if mode != "plain":
        checks["main_grad dropped"] = equal(
            [p.name for p in params if np.abs(p.main_grad.asnumpy()).max() != 0], [])
    # the next step trains exactly
    model.zero_grad()
    _, grads = grad_fn(ms.Tensor(local))
    got = [p.main_grad for p in params] if mode != "plain" else list(grads)
    _, want = ref_fn(ms.Tensor(whole))
    for param, g, w in zip(params, got, want):
        w = w.asnumpy()
        checks[f"next step {param.name}"] = pc.allclose(
            g, pc.np_local(param.hsdp_param, w), rtol=0.0,
            atol=pc.GRAD_TOL * (float(np.abs(w).max(initial=0.0)) or 1.0))
    return checks


for _mode in pc.MODES:
    suite.add(f"units_swapped_on_one_rank_refused_{_mode}",
              lambda ctx, mode=_mode: swap_case(ctx, mode, fused=False))
suite.add("units_swapped_on_one_rank_refused_fused",
          lambda ctx: swap_case(ctx, "main_async", fused=True))
suite.add("units_swapped_on_one_rank_refused_strict",
          lambda ctx: swap_case(ctx, "main_async", fused=False, check_unit_order="strict"))


@suite.case
def ranks_differ_only_in_the_kind_of_collective(ctx) -> dict:
    """On the last rank unit ``a``'s reduce carries the tag of ``a``'s all-gather (the ranks ran
    the same unit, another collective): the message names the reduce on rank 0 and the
    all-gather on the last rank."""
    config = GradPoolConfig(async_reduce=True)
    model = _sharded(pc.Net(), "main_async", config)
    grad_fn = ms.value_and_grad(lambda x: pc.loss_of(model, x), None, model.trainable_params())
    local, _ = pc._batch(0, ctx.rank, ctx.world_size, pc.ROWS)   # pylint: disable=protected-access
    unit = model.a._hsdp_state                   # pylint: disable=protected-access
    original = unit.order_tag
    if ctx.rank == ctx.world_size - 1:
        unit.reduce_path._order_tag = lambda kind, agree=True: original(GATHER, agree)  # pylint: disable=protected-access
    checks = {"refused, naming each rank's collective": raises(
        UnsupportedPatternError, lambda: grad_fn(ms.Tensor(local)),
        "rank 0 at the reduce of unit 'a' (Lin)",
        f"rank {ctx.world_size - 1} at the all-gather of unit 'a' (Lin)")}
    unit.reduce_path._order_tag = original       # pylint: disable=protected-access
    model.zero_grad()
    grad_fn(ms.Tensor(local))
    identities = {u.order_identity: u for u in model._hsdp_units()}   # pylint: disable=protected-access
    checks["next step: nothing refused, the flag read"] = equal(RUNTIME.order_flag.pending, False)
    checks["identities differ per unit"] = equal(len(identities),
                                                 len(model._hsdp_units()))   # pylint: disable=protected-access
    checks["tags name unit and kind"] = equal(
        tag_of(unit.order_identity, REDUCE) - tag_of(unit.order_identity, GATHER), 1)
    return checks


def gather_carries_another_units_tag(ctx, mesh=None) -> dict:
    """On the last rank unit ``a``'s all-gathers carry unit ``b``'s tag, its reduce its own:
    only the gathers disagree (on an HSDP ``mesh`` only inside the last shard group, whose
    mismatch reaches the other group through the flag the reduces and the replicate all-reduce
    carry on each tag's last pair). Refused on every rank, naming the all-gathers; the next step runs."""
    config = GradPoolConfig(async_reduce=True)
    model = _sharded(pc.Net(), "main_async", config, mesh=mesh)
    grad_fn = ms.value_and_grad(lambda x: pc.loss_of(model, x), None, model.trainable_params())
    local, _ = pc._batch(0, ctx.rank, ctx.world_size, pc.ROWS)   # pylint: disable=protected-access
    unit, other = model.a._hsdp_state, model.b._hsdp_state   # pylint: disable=protected-access
    original = unit.memory._order_tag                        # pylint: disable=protected-access
    if ctx.rank == ctx.world_size - 1:
        unit.memory._order_tag = other.order_tag                 # pylint: disable=protected-access
    checks = {"refused, naming the all-gathers": raises(
        UnsupportedPatternError, lambda: grad_fn(ms.Tensor(local)),
        f"{_ranks(list(range(ctx.world_size - 1)))} at the all-gather of unit 'a' (Lin)",
        f"rank {ctx.world_size - 1} at the all-gather of unit 'b' (Lin)")}
    unit.memory._order_tag = original                        # pylint: disable=protected-access
    model.zero_grad()
    grad_fn(ms.Tensor(local))
    checks["next step: nothing refused"] = equal(RUNTIME.order_flag.pending, False)
    return checks


suite.add("gather_carries_another_units_tag", gather_carries_another_units_tag)


@suite.case
def unit_skipped_on_one_rank_refused_in_strict_mode(ctx) -> dict:
    """A unit skipped on one rank only (the collective counts differ: the default check cannot
    finish the step; it hangs or fails in the collective) is refused before the collective in
    strict mode, on every rank, naming the unit."""
    config = GradPoolConfig(check_unit_order="strict")
    model = _sharded(pc.Net(), "main_async", config)
    grad_fn = ms.value_and_grad(lambda x: pc.loss_of(model, x), None, model.trainable_params())
    local, _ = pc._batch(0, ctx.rank, ctx.world_size, pc.ROWS)   # pylint: disable=protected-access
    model.skip_b = ctx.rank == ctx.world_size - 1
    checks = {"refused": raises(UnsupportedPatternError, lambda: grad_fn(ms.Tensor(local)),
                                "different order", "unit 'b' (Lin)")}
    model.skip_b = False
    model.zero_grad()
    return checks


# -- host reads per step ----------------------------------------------------------------------------
# (mode, comm_fusion, recompute, micro-steps): the default GradPoolConfig (no debug options)
READ_CASES = {
    "plain": ("plain", False, "", ""),
    "main_async": ("main_async", False, "", ""),
    "main_sync": ("main_sync", False, "", ""),
    "main_async_fused": ("main_async", True, "", ""),
    "plain_fused": ("plain", True, "", ""),
    "main_async_recompute": ("main_async", False, "after_nonreentrant", ""),
    "plain_checkpoint_wrapper": ("plain", False, "wrapper", ""),
    "main_async_micro_steps_without_sync": ("main_async", False, "", "no_sync"),
    "plain_micro_steps_without_sync": ("plain", True, "", "no_sync"),
    "main_async_micro_steps_not_last_backward": ("main_async", False, "", "not_last"),
}
# HSDP also keeps partial sums between micro-steps without the replicate all-reduce
HSDP_READ_CASES = {**READ_CASES,
                   "main_async_micro_steps_without_all_reduce": ("main_async", False, "",
                                                                 "no_all_reduce"),
                   "plain_micro_steps_without_all_reduce": ("plain", False, "", "no_all_reduce")}


def host_reads_per_step(ctx, case: tuple, mesh=None, steps: int = 2) -> list:
    """Train ``steps`` optimizer steps (after one warm-up), counting host reads by our code in
    each (forward, backward and the end of backward: everything before the optimizer)."""
    mode, fused, recompute, micro = case
    config = GradPoolConfig(async_reduce=mode == "main_async")
    model = _sharded(pc.Net(), mode, config, mesh=mesh, fused=fused)
    if recompute == "after_nonreentrant":
        model.a.recompute(use_reentrant=False)
    elif recompute == "wrapper":
        model.a = pc.checkpoint_wrapper(model.a)
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda x: pc.loss_of(model, x), None, params)
    count = pc.MICRO if micro else 1
    per_step = []
    for step in range(steps + 1):
        model.zero_grad()
        with count_host_reads() as reads:
            for index in range(count):
                if micro == "no_sync":
                    model.set_requires_gradient_sync(index == count - 1)
                elif micro == "not_last":
                    model.set_is_last_backward(index == count - 1)
                elif micro == "no_all_reduce":
                    model.set_requires_all_reduce(index == count - 1)
                local, _ = pc._batch(step, ctx.rank, ctx.world_size, pc.ROWS)   # pylint: disable=protected-access
                grad_fn(ms.Tensor(local))
        if step:
            per_step.append(reads.summary())
    return per_step


def read_checks(label: str, per_step: list) -> dict:
    """Per step: no host read by the library but the order flag's one (CPU-only ones apart)."""
    checks = {}
    for step, summary in enumerate(per_step):
        checks[f"{label} step {step}: device-independent host reads"] = equal(
            summary["device_independent"], {})
        checks[f"{label} step {step}: order-flag reads"] = equal(summary["order_flag"], 1)
    return checks


@suite.case
def host_reads_in_a_training_step(ctx) -> dict:
    """Per optimizer step, in every mode: no host read by gradpool or hyper_parallel code but the
    one read of the order flag and the CPU-only host path (counted apart, listed in
    docs/design.md); the CPU-only ones are reported."""
    checks = {}
    for label, case in READ_CASES.items():
        per_step = host_reads_per_step(ctx, case)
        checks.update(read_checks(label, per_step))
        print(f"rank {ctx.rank} {label}: CPU-only host reads per step {per_step[-1]['cpu_only']}",
              file=sys.stderr)
    return checks


def clipped_steps(ctx, mesh=None, fused: bool = False, steps: int = 2) -> dict:
    """main_grad mode with asynchronous reduces and ``clip_grad_norm_`` in every step (after one
    warm-up): per step, the host reads of forward and backward and of the clipping, counted
    apart; the norm and every clipped ``main_grad`` against NumPy's clipping of the unsharded
    model's gradients. ``max_norm`` is half the norm on odd steps (clipped), twice it on even
    ones (scaled by 1: unchanged)."""
    model = _sharded(pc.Net(), "main_async", GradPoolConfig(async_reduce=True), mesh=mesh,
                     fused=fused)
    ref = pc.Net()
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda x: pc.loss_of(model, x), None, params)
    ref_fn = ms.value_and_grad(lambda x: pc.loss_of(ref, x), None, ref.trainable_params())
    checks = {}
    for step in range(steps + 1):
        local, whole = pc._batch(step, ctx.rank, ctx.world_size, pc.ROWS)   # pylint: disable=protected-access
        want = [w.asnumpy().astype(np.float64) for w in ref_fn(ms.Tensor(whole))[1]]
        want_norm = float(np.sqrt(sum((w * w).sum() for w in want)))
        max_norm = want_norm * (0.5 if step % 2 else 2.0)
        coef = min(1.0, max_norm / (want_norm + 1e-6))
        model.zero_grad()
        with count_host_reads() as backward:
            grad_fn(ms.Tensor(local))
        with count_host_reads() as clipping:
            norm = clip_grad_norm_(params, max_norm)
        if not step:
            continue
        label = f"step {step} ({'clipped' if coef < 1 else 'not clipped'})"
        both = backward.summary()
        clip = clipping.summary()
        checks[f"{label}: forward and backward, device-independent host reads"] = equal(
            both["device_independent"], {})
        checks[f"{label}: clip_grad_norm_, device-independent host reads"] = equal(
            clip["device_independent"], {})
        checks[f"{label}: library host reads in the step, clipping included"] = equal(
            both["order_flag"] + clip["order_flag"], 1)
        checks[f"{label}: the norm"] = pc.allclose(norm, np.array(want_norm), rtol=1e-5)
        for param, w in zip(params, want):
            checks[f"{label}: clipped main_grad {param.name}"] = pc.allclose(
                param.main_grad, pc.np_local(param.hsdp_param, w * coef), rtol=0.0,
                atol=pc.GRAD_TOL * (float(np.abs(w).max(initial=0.0)) or 1.0))
        print(f"rank {ctx.rank} clipping {label}: CPU-only host reads {clip['cpu_only']}",
              file=sys.stderr)
    return checks


@suite.case
def host_reads_in_a_training_step_with_clipping(ctx) -> dict:
    """host_reads_in_a_training_step with ``clip_grad_norm_`` in the step (main_grad, uneven
    shards): still one library host read per optimizer step, the order flag's."""
    return clipped_steps(ctx)


def ep_host_reads_per_step(ctx, mode: str, steps: int = 2) -> list:
    """host_reads_per_step for the tiny DeepSeek-V3 with expert parallelism 2 (each layer's
    experts a unit on their EDP sub-mesh, all-gather dispatcher), as ``gradpool train`` builds
    it."""
    from gradpool.app.config import from_dict
    from gradpool.app.model import make_batch_np, next_token_loss
    from gradpool.app.train import build_sharded_model
    main_grad = mode != "plain"
    cfg = from_dict({}, [
        "model.expert_hidden=23", "model.batch_size=2", "fully_shard.reduce_dtype=float32",
        f"launch.ranks={ctx.world_size}", "model.expert_parallel=2", "model.num_experts=4",
        "model.experts_per_token=2", "model.moe_dispatcher=all-gather",
        f"fully_shard.apply_grad_on_fp32_main_grad={str(main_grad).lower()}",
        f"gradpool.async_reduce={str(mode == 'main_async').lower()}"])
    model = build_sharded_model(cfg)
    grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None,
                                model.trainable_params())
    per_step = []
    for step in range(steps + 1):
        batch = ms.Tensor(make_batch_np(cfg.model, step, ctx.rank, ctx.world_size,
                                        seed=cfg.train.seed))
        model.zero_grad()
        with count_host_reads() as reads:
            grad_fn(batch)
        if step:
            per_step.append(reads.summary())
    return per_step


@suite.case
def ep2_host_reads_in_a_training_step(ctx) -> dict:
    """host_reads_in_a_training_step with expert parallelism 2, plain and main_grad."""
    checks = {}
    for mode in ("plain", "main_async"):
        per_step = ep_host_reads_per_step(ctx, mode)
        checks.update(read_checks(f"ep2 {mode}", per_step))
        # the app's MoE stand-in (not the library) reads its routing once per MoE layer
        checks[f"ep2 {mode}: the model's own reads per step"] = equal(
            [sum(step["model"].values()) for step in per_step], [2] * len(per_step))
    return checks


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
