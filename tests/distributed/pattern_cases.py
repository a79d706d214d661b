"""Training code as users write it, under fully_shard, against the same model unsharded
(tests/test_patterns_distributed.py at 2 ranks; tests/test_patterns.py runs them at world size
1 in-process).

Each case trains through both entry points: ``value_and_grad`` (named ``<case>_<mode>``) and
torch-style ``loss.backward()`` after ``enable_mindspore_backward_compat()`` (named
``<case>_<mode>_backward``; plain mode reads each shard's ``grad``, main_grad mode its
``main_grad`` and checks ``grad`` stays None). The unsharded reference always trains through
``value_and_grad``, which turns MindSpore's grad flag off when it returns; the torch-style run
turns it back on right after it, so each ``model.zero_grad()`` sees what a completed
``loss.backward()`` left.

The model: a root (its own head) over three units, ``embed`` (5 -> 7), ``a`` and ``b`` (7 -> 7),
every dimension odd so at 2 ranks each parameter's dim 0 needs padding (uneven shards: where the
bugs of this file showed). Every case trains STEPS steps of plain SGD on each rank's rows of a
global batch and, per step, compares each rank's shard gradient (returned by ``value_and_grad``
in plain mode, ``main_grad`` in main_grad mode) with its chunk of the unsharded model's gradient
of the mean loss over the global batch, in three modes: plain (synchronous), main_grad with the
asynchronous reduce (the default), main_grad synchronous. Every run has ``poison_on_release``
on (a read of recycled or released memory turns values NaN) and ``verify_gradients``.

Tolerance: the sharded run averages per-rank means; the reference takes one mean over the whole
batch: the same sums in another order, float32. ``GRAD_TOL`` is relative to the tensor's largest
magnitude (measured below 3e-7 for these models).
"""
from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field
from pathlib import Path

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn, ops

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: npref

from gradpool import GradPoolConfig, UnsupportedPatternError, runtime_for
from harness import Suite, allclose, equal, raises, wrapped_communicators
from hyper_parallel import fully_shard, init_device_mesh
from hyper_parallel.core.activation_checkpoint import checkpoint, checkpoint_wrapper
from hyper_parallel.core.fully_shard import MixedPrecisionPolicy
from hyper_parallel.platform.mindspore.fully_shard.runtime import RUNTIME
from hyper_parallel.platform.mindspore.autograd_compat import (disable_mindspore_backward_compat,
                                                               enable_mindspore_backward_compat)
from npref import np_chunk, np_local
import tied_cases  # noqa: E402  (its cases join this suite)

suite = Suite("patterns", blocking_launch=True)
STEPS = 3
ROWS = 4                 # per rank
LR = 0.3
GRAD_TOL = 2e-6
MODES = ("plain", "main_async", "main_sync")
ENTRIES = ("value_and_grad", "backward")
# the synchronous main_grad reduce is a reduce-path variant, not an entry-point one: torch-style
# backward runs plain and main_grad with the asynchronous reduce
BACKWARD_MODES = ("plain", "main_async")
MICRO = 3                # micro-batches per optimizer step in the micro-step cases
FAIL = {"where": None}   # where the next forward raises: "a", "root", "loss" or None


class Lin(nn.Cell):
    def __init__(self, rng, fan_in: int, fan_out: int, tag: str, frozen_bias: bool = False):
        super().__init__()
        self.tag = tag
        self.w = Parameter(ms.Tensor((rng.standard_normal((fan_out, fan_in)) * .5)
                                     .astype(np.float32)), name=f"{tag}.w")
        self.b = Parameter(ms.Tensor((rng.standard_normal(fan_out) * .5).astype(np.float32)),
                           name=f"{tag}.b", requires_grad=not frozen_bias)

    def construct(self, x):
        if FAIL["where"] == self.tag:
            raise RuntimeError(f"injected failure in {self.tag}")
        return mint.tanh(mint.matmul(x, self.w.T) + self.b)


class Net(nn.Cell):
    """``pattern`` picks the forward (see each case)."""

    def __init__(self, pattern: str = "plain", frozen_bias: bool = False):
        super().__init__()
        rng = np.random.default_rng(7)
        self.pattern = pattern
        self.skip_b = False
        self.embed = Lin(rng, 5, 7, "embed")
        self.a = Lin(rng, 7, 7, "a", frozen_bias=frozen_bias)
        self.b = Lin(rng, 7, 7, "b")
        self.head = Lin(rng, 7, 3, "head")

    def construct(self, x):
        h = self.embed(x)
        if self.pattern == "twice":
            h = self.a(self.a(h))
        elif self.pattern == "recompute_fn":
            h = ms.recompute(self.a, h, use_reentrant=False)
        elif self.pattern == "recompute_fn_reentrant":    # MindSpore's default: refused
            h = ms.recompute(self.a, h)
        elif self.pattern == "checkpoint":
            h = checkpoint(self.a, h)
        else:
            h = self.a(h)
        if FAIL["where"] == "root":
            raise RuntimeError("injected failure in the root, between units")
        if not self.skip_b:
            h = self.b(h)
        if self.pattern == "tie":       # the root computes with a's weight, outside a's unit
            h = mint.tanh(mint.matmul(h, self.a.w))
        return self.head(h)


def loss_of(model, x):
    out = model(x)
    if FAIL["where"] == "loss":
        raise RuntimeError("injected failure in the loss, after the model")
    return (out * out).mean()


@dataclass
class Run:
    """How one case builds and drives its two models."""

    pattern: str = "plain"
    mode: str = "plain"
    entry: str = "value_and_grad"   # or "backward": torch-style loss.backward()
    recompute: str = ""            # "", "before", "after", "after_nonreentrant", "wrapper"
    frozen_bias: bool = False
    skip_b_at: tuple = ()          # steps whose forward skips unit b
    skip_b_on_last_rank_at: tuple = ()  # steps whose forward skips b on the last rank only:
    #                                    refused on every rank, the step abandoned (world 1: a
    #                                    skip); the collective counts differ, so only the strict
    #                                    unit-order check refuses it (before the collective)
    seq_lens: tuple = ()           # per step: rows per rank (dynamic shapes); () = ROWS
    fail_before: tuple = ()        # failures injected (caught) before step 0: where a forward
    #                                raises, or "reentrant_recompute" (a refused backward)
    reshard: bool = True
    mesh: tuple = ()               # () = every rank in one shard group; (2, 2) = HSDP
    forward_prefetch: bool = False  # embed prefetches a, a prefetches b (explicit)
    fused: bool = False            # comm_fusion: one bucket per unit and dtype
    recompute_at: tuple = ()       # steps before which a.recompute() (reentrant) is called again
    micro: str = ""                # "": one batch per step; MICRO micro-batches reduced at each
    #                                ("sync") or accumulated without sync until the last ("no_sync")
    extra: dict = field(default_factory=dict)


def _build(run: Run, world: int):
    model = Net(run.pattern, run.frozen_bias)
    if run.recompute == "before":
        model.a.recompute()
    mp = MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=run.mode != "plain")
    config = GradPoolConfig(poison_on_release=True, verify_gradients=True,
                            async_reduce=run.mode == "main_async",
                            check_unit_order="strict" if run.skip_b_on_last_rank_at else True)
    mesh = {}
    if run.mesh:
        mesh["mesh"] = init_device_mesh("cpu", run.mesh, mesh_dim_names=("dp_replicate", "fsdp"))
    for name in ("embed", "a", "b"):
        fully_shard(getattr(model, name), mp_policy=mp, pool_config=config,
                    reshard_after_forward=run.reshard, comm_fusion=run.fused, **mesh)
    fully_shard(model, mp_policy=mp, pool_config=config, reshard_after_forward=run.reshard,
                comm_fusion=run.fused, **mesh)
    if run.forward_prefetch:
        model.embed.set_modules_to_forward_prefetch([model.a])
        model.a.set_modules_to_forward_prefetch([model.b])
    if run.recompute == "after":
        model.a.recompute()
    elif run.recompute == "after_nonreentrant":
        model.a.recompute(use_reentrant=False)
    elif run.recompute == "wrapper":
        model.a = checkpoint_wrapper(model.a)
    return model, config


def _reference(run: Run):
    ref = Net(run.pattern, run.frozen_bias)
    if run.recompute:
        ref.a.recompute(use_reentrant=False)
    return ref


def _batch(step: int, rank: int, world: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(100 + step).standard_normal((rows * world, 5)).astype(np.float32)
    return x[rank * rows:(rank + 1) * rows], x


def _sgd(params, grads) -> None:
    for param, grad in zip(params, grads):
        ops.assign(param, param - LR * grad)


def gradient_step(model, params, entry: str):
    """``x ->`` the gradients autograd gives ``params`` for ``loss_of(model, x)``: what
    ``value_and_grad`` returns, or each parameter's ``grad`` after torch-style
    ``loss.backward()`` (None where nothing was accumulated)."""
    if entry == "value_and_grad":
        grad_fn = ms.value_and_grad(lambda x: loss_of(model, x), None, params)
        return lambda x: grad_fn(x)[1]

    def backward(x):
        loss_of(model, x).backward()
        return tuple(param.grad for param in params)
    return backward


def _inject_failures(model, run: Run, rank: int, world: int) -> dict:
    checks = {}
    grad_fn = gradient_step(model, model.trainable_params(), run.entry)
    local, _ = _batch(99, rank, world, ROWS)
    for where in run.fail_before:
        if where == "reentrant_recompute":
            model.pattern = "recompute_fn_reentrant"
            if run.entry == "backward":
                # MindSpore's reentrant recompute needs value_and_grad's top cell: its forward
                # raises under torch-style backward, sharded or not
                checks["reentrant recompute fails in MindSpore's forward"] = raises(
                    RuntimeError, lambda: grad_fn(ms.Tensor(local)), "top_cell")
            else:
                checks["reentrant recompute refused"] = raises(
                    UnsupportedPatternError, lambda: grad_fn(ms.Tensor(local)), "Lin",
                    "use_reentrant=False")
            model.pattern = run.pattern
            model.zero_grad()
            continue
        FAIL["where"] = where
        try:
            grad_fn(ms.Tensor(local))
            checks[f"failure in {where} raised"] = equal("no exception", "RuntimeError")
        except RuntimeError as exc:
            checks[f"failure in {where} raised"] = equal("injected failure" in str(exc), True)
        finally:
            FAIL["where"] = None
        if where == "loss":
            # the model's forward completed: its uses await a backward that never comes, and
            # zero_grad (between steps) is what abandons them
            model.zero_grad()
        units = model._hsdp_units()                # pylint: disable=protected-access
        checks[f"failure in {where}: uses awaiting a backward, per unit"] = equal(
            [u.steps.uses_awaiting_backward for u in units], [0] * len(units))
        checks[f"failure in {where}: live leases"] = equal(
            units[0].reducer.pool.stats().live_leases, 0)
        model.zero_grad()
    return checks


class MainGradWatch:
    """Watches when each parameter's ``main_grad`` holds memory (main_grad mode), through every
    unit's landing and ``zero_grad`` (its reduce path's own methods, wrapped; the collectives
    run for real): from ``zero_grad`` until a parameter's first reduced shard lands, its
    ``main_grad`` holds nothing (``main_grad_held`` None), so at each landing no parameter of a
    unit that has not landed since the last ``zero_grad`` may hold one, and after it the unit's
    every parameter holds a float32 tensor of its local shape."""

    def __init__(self, model):
        self.units = model._hsdp_units()           # pylint: disable=protected-access
        self.landed: set = set()                   # units landed since the last zero_grad
        self.early: list = []                      # (unit, parameter) held before its landing
        self.after_landing: list = []              # what a landed unit's parameters hold
        self.after_zero: list = []                 # parameters still holding after zero_grad
        self.landings = 0
        for unit in self.units:
            path = unit.reduce_path
            path._land_in_main_grad = self._landing(unit, path._land_in_main_grad)
            path.zero_grad = self._zeroing(unit, path.zero_grad)

    def _held(self, unit) -> list:
        return [p for p in unit.params if p.main_grad_held is not None]

    def _landing(self, unit, land):
        def watched():
            self.early += [(u.params[0].name, p.name) for u in self.units
                           if id(u) not in self.landed for p in self._held(u)]
            land()
            self.landed.add(id(unit))
            self.landings += 1
            self.after_landing += [
                (p.name, None if p.main_grad_held is None else
                 (str(p.main_grad_held.dtype), tuple(p.main_grad_held.shape) == p.local_shape))
                for p in unit.params]
        return watched

    def _zeroing(self, unit, zero):
        def watched():
            zero()
            self.landed.discard(id(unit))
            self.after_zero += [p.name for p in self._held(unit)]
        return watched

    def after_backward(self, step: int, skipped: set) -> dict:
        """Before the optimizer reads ``main_grad``: the units that ran hold it, a skipped unit
        holds nothing yet (reading it makes zeros, compared with the reference's)."""
        held = sorted(p.name for u in self.units for p in self._held(u))
        want = sorted(p.name for u in self.units for p in u.params
                      if not {p.name.split(".")[0]} & skipped)
        return {f"step {step}: main_grad held by the parameters of the units that ran only":
                equal(held, want)}

    def checks(self, landings: int) -> dict:
        return {
            "main_grad held before its unit's first landing since zero_grad": equal(self.early,
                                                                                    []),
            "main_grad held after zero_grad": equal(self.after_zero, []),
            "every landing leaves float32 main_grad of the local shape": equal(
                sorted({v for _, v in self.after_landing}, key=str), [("Float32", True)]),
            "landings watched": equal(self.landings, landings),
        }


class EarlyLandingWatch:
    """Watches, at each unit's reduce launch in a backward (main_grad mode, asynchronous reduce),
    every unit whose reduce was launched two or more launches before in the same step: its reduce
    must have landed by then, not at the end of backward: each of its parameters' ``main_grad``
    holds the step's reduced shard (compared with the unsharded reference after the step) and its
    output bucket is back in the pool (its result released). The launches are the unit's own
    reduce path's (wrapped; the collectives run for real)."""

    def __init__(self, model):
        self.launched: list = []        # units whose reduce launched in this step, in order
        self.seen: list = []            # (launching, earlier, {param: (main_grad copy, bucket back)})
        self.params = {}
        for unit in model._hsdp_units():           # pylint: disable=protected-access
            if unit.params:
                unit.reduce_path.reduce = self._launch(unit, unit.reduce_path.reduce)
                self.params.update({p.name: p for p in unit.params})

    @staticmethod
    def _name(unit) -> str:
        return unit.params[0].name.split(".")[0]

    def _launch(self, unit, reduce):
        def watched(params, op):
            for earlier in self.launched[:-1]:
                self.seen.append((self._name(unit), self._name(earlier), {
                    p.name: (None if p.main_grad_held is None else p.main_grad_held.asnumpy().copy(),
                             p._slot is None)                # pylint: disable=protected-access
                    for p in earlier.params}))
            reduce(params, op)
            self.launched.append(unit)
        return watched

    def step_checks(self, step: int, want: dict) -> dict:
        """``want``: parameter name -> the reference's full gradient of the step."""
        order = [self._name(u) for u in self.launched]
        expected = [(order[k], order[j]) for k in range(len(order)) for j in range(k - 1)]
        checks = {
            f"step {step}: one launch per unit": equal(sorted(order), ["a", "b", "embed", "head"]),
            f"step {step}: at each launch every reduce launched two or more before has landed": equal(
                [(a, b, all(g is not None and back for g, back in held.values()))
                 for a, b, held in self.seen], [(a, b, True) for a, b in expected]),
        }
        for launching, earlier, held in self.seen:
            for name, (got, _) in held.items():
                if got is None:
                    continue
                full = want[name]
                scale = float(np.abs(full).max(initial=0.0)) or 1.0
                checks[f"step {step}: {name} landed before {launching} launched"] = allclose(
                    got, np_local(self.params[name], full), rtol=0.0, atol=GRAD_TOL * scale)
        self.launched, self.seen = [], []
        return checks


def train_and_compare(ctx, run: Run) -> dict:
    if run.entry == "value_and_grad":
        return _train_and_compare(ctx, run)
    enable_mindspore_backward_compat()
    try:
        return _train_and_compare(ctx, run)
    finally:       # later cases of the process train through value_and_grad
        disable_mindspore_backward_compat()


def _train_and_compare(ctx, run: Run) -> dict:
    rank, world = ctx.rank, ctx.world_size
    model, config = _build(run, world)
    ref = _reference(run)
    params = model.trainable_params()
    ref_params = ref.trainable_params()
    checks = _inject_failures(model, run, rank, world)
    grad_fn = gradient_step(model, params, run.entry)
    ref_fn = ms.value_and_grad(lambda x: loss_of(ref, x), None, ref_params)
    pool = runtime_for(config).pool
    watch = MainGradWatch(model) if run.extra.get("watch_main_grad") else None
    early = EarlyLandingWatch(model) if run.extra.get("watch_early_landing") else None
    reserved = []
    for step in range(STEPS):
        rows = run.seq_lens[step] if run.seq_lens else ROWS
        local, whole = _batch(step, rank, world, rows)
        model.skip_b = ref.skip_b = step in run.skip_b_at or (
            step in run.skip_b_on_last_rank_at and world == 1)
        model.zero_grad()
        if step in run.recompute_at:     # switched on (again) between steps, after forwards ran
            model.a.recompute()
        if step in run.skip_b_on_last_rank_at and world > 1:
            model.skip_b = rank == world - 1
            checks[f"step {step}: b skipped on rank {world - 1} only, refused"] = raises(
                UnsupportedPatternError, lambda: grad_fn(ms.Tensor(local)), "different order",
                "unit 'b' (Lin)", f"rank {world - 1} at the ", "of unit 'a' (Lin)")
            model.skip_b = False
            reserved.append(pool.stats().bytes_reserved)
            continue            # abandoned on every rank: no update, as for the reference
        grads, ref_grads = _accumulated_grads(model, run, grad_fn, ref_fn, step, rank, world,
                                              rows)
        if watch is not None:
            checks.update(watch.after_backward(step, {"b"} if model.skip_b else set()))
        if early is not None:
            checks.update(early.step_checks(step, {p.name: g for p, g in zip(params, ref_grads)}))
        if run.entry == "backward":
            if run.mode != "plain":
                checks[f"step {step}: grad stays None in main_grad mode"] = equal(
                    [p.name for p, g in zip(params, grads) if g is not None], [])
        got = [p.main_grad for p in params] if run.mode != "plain" else list(grads)
        # torch-style: a shard whose unit did not run has no grad (the reference's is zeros)
        got = [mint.zeros(p.shape, dtype=ms.float32) if g is None else g
               for p, g in zip(params, got)]
        for param, g, want in zip(params, got, ref_grads):
            expected = np_local(param.hsdp_param, want)
            scale = float(np.abs(want).max(initial=0.0)) or 1.0
            checks[f"step {step} {param.name}"] = allclose(g, expected, rtol=0.0,
                                                           atol=GRAD_TOL * scale)
        _sgd(params, got)
        _sgd(ref_params, [ms.Tensor(g) for g in ref_grads])
        reserved.append(pool.stats().bytes_reserved)
        if run.recompute or run.recompute_at:   # a reentrant recompute cell is switched, not kept
            checks[f"step {step}: reentrant recompute cells left in a"] = equal(
                [n for n, c in model.a.cells_and_names() if type(c).__name__ == "_RecomputeCell"],
                [])
    model.zero_grad()
    if watch is not None:
        checks.update(watch.checks(run.extra["landings"]))
    checks["no lease held after the steps"] = equal(pool.stats().live_leases, 0)
    # buckets are reserved in the first step and reused (shapes, skipped units, uses vary)
    checks["pool reserved nothing after step 0"] = equal(reserved, reserved[:1] * STEPS)
    if run.frozen_bias:     # a frozen parameter stays whole and outside the reduce path
        checks["frozen parameter not managed"] = equal(
            (hasattr(model.a.b, "hsdp_param"), tuple(model.a.b.shape)), (False, (7,)))
    return checks


def _accumulated_grads(model, run: Run, grad_fn, ref_fn, step: int, rank: int, world: int,
                       rows: int) -> tuple:
    """One optimizer step's gradients: the sharded model's as autograd gives them (summed over
    value_and_grad's results; torch-style ``grad`` sums itself) and the reference's, summed over
    the micro-batches as NumPy arrays (``run.micro``: MICRO micro-batches, reduced at each one
    or accumulated without sync until the last)."""
    count = MICRO if run.micro else 1
    grads, ref_total = None, None
    for micro in range(count):
        if run.micro == "no_sync":
            model.set_requires_gradient_sync(micro == count - 1)
        local, whole = _batch(step if not run.micro else 1000 * (micro + 1) + step, rank, world,
                              rows)
        got = grad_fn(ms.Tensor(local))
        _, ref_grads = ref_fn(ms.Tensor(whole))
        if run.entry == "backward":
            enable_mindspore_backward_compat()    # value_and_grad turned the grad flag off
            grads = got                           # each grad holds the sum so far
        else:
            grads = got if grads is None else [mint.add(a, b) for a, b in zip(grads, got)]
        ref_grads = [np.asarray(g.asnumpy(), np.float32) for g in ref_grads]
        ref_total = ref_grads if ref_total is None else [a + b for a, b in zip(ref_total,
                                                                             ref_grads)]
    return tuple(grads), ref_total


def add_cases(into: Suite, name: str, run: Run, modes=MODES, entries=ENTRIES) -> None:
    for entry in entries:
        for mode in modes:
            if entry == "backward" and mode not in BACKWARD_MODES:
                continue

            def case(ctx, run=run, mode=mode, entry=entry):
                run = Run(**{**run.__dict__, "mode": mode, "entry": entry})
                return train_and_compare(ctx, run)
            into.add(f"{name}_{mode}" + ("_backward" if entry == "backward" else ""), case)


def _add(name: str, run: Run, modes=MODES) -> None:
    add_cases(suite, name, run, modes)


_add("plain_model", Run())
_add("unit_applied_twice", Run(pattern="twice"))
_add("unit_applied_twice_kept_gathered", Run(pattern="twice", reshard=False), ("plain",))
_add("unit_applied_twice_forward_prefetch", Run(pattern="twice", forward_prefetch=True))
_add("recompute_before_fully_shard", Run(recompute="before"))
_add("recompute_after_fully_shard", Run(recompute="after"))
_add("recompute_non_reentrant", Run(recompute="after_nonreentrant"))
_add("recompute_switched_on_between_steps", Run(recompute_at=(1, 2)))
_add("recompute_functional", Run(pattern="recompute_fn"))
_add("recompute_checkpoint", Run(pattern="checkpoint"))
_add("recompute_checkpoint_wrapper", Run(recompute="wrapper"))
_add("forward_raised_in_a_unit_root_and_loss", Run(fail_before=("a", "root", "loss")))
_add("reentrant_functional_recompute_refused", Run(fail_before=("reentrant_recompute",)))
_add("unit_skipped_in_a_step", Run(skip_b_at=(1,)))
_add("unit_skipped_on_one_rank_only", Run(skip_b_on_last_rank_at=(1,)))
_add("unit_skipped_on_one_rank_only_kept_gathered", Run(skip_b_on_last_rank_at=(1,),
                                                        reshard=False), ("main_async",))
_add("weight_read_outside_its_unit", Run(pattern="tie"))
_add("dynamic_rows_and_a_frozen_parameter", Run(frozen_bias=True, seq_lens=(4, 2, 3)))
_add("micro_steps_reduced_each", Run(micro="sync"))
_add("micro_steps_without_sync", Run(micro="no_sync"))
# main_grad costs memory only once it holds a gradient: allocated at its unit's first landing
# after zero_grad (MICRO micro-batches reduced at each: the later ones add into it), unit b
# skipped in step 1 (its main_grad, never landed, read as zeros by the optimizer); landings: 4
# units x MICRO micro-batches in steps 0 and 2, 3 units in step 1
_add("main_grad_allocated_at_its_first_landing",
     Run(skip_b_at=(1,), micro="sync",
         extra={"watch_main_grad": True, "landings": (4 + 3 + 4) * MICRO}),
     ("main_async", "main_sync"))


# an asynchronous reduce lands when the unit after the next one launches its own (its output
# bucket back in the pool), not at the end of backward: with four units the third launch finds
# the first landed, the fourth the first two
_add("reduces_land_two_launches_later", Run(extra={"watch_early_landing": True}), ("main_async",))


def through_both_entries(fn):
    """Register ``fn(ctx, entry)`` as ``<name>`` (value_and_grad) and ``<name>_backward``."""
    for entry in ENTRIES:
        def case(ctx, entry=entry):
            if entry == "value_and_grad":
                return fn(ctx, entry)
            enable_mindspore_backward_compat()
            try:
                return fn(ctx, entry)
            finally:
                disable_mindspore_backward_compat()
        suite.add(fn.__name__ + ("_backward" if entry == "backward" else ""), case)
    return fn


@through_both_entries
def pool_memory_never_reaches_autograd(ctx, entry) -> dict:
    """Plain mode: the shard gradients autograd gives (value_and_grad's result, or each grad
    after loss.backward()) share no byte with any pool allocation (they are autograd's own
    memory), for a unit used twice."""
    model, config = _build(Run(pattern="twice"), ctx.world_size)
    local, _ = _batch(0, ctx.rank, ctx.world_size, ROWS)
    grads = gradient_step(model, model.trainable_params(), entry)(ms.Tensor(local))
    pool = runtime_for(config).pool
    named = {p.name: g for p, g in zip(model.trainable_params(), grads)}
    return {"buckets exist": equal(len(pool._buckets) > 0, True),   # pylint: disable=protected-access
            "returned gradients overlapping a pool bucket": equal(
                _sharing_a_bucket(pool, named), [])}


def _sharing_a_bucket(pool, tensors: dict) -> list:
    """The names of ``tensors`` whose storage overlaps a pool bucket's."""
    spans = [(b.tensor.untyped_storage().data_ptr(), b.nbytes)
             for b in pool._buckets]                      # pylint: disable=protected-access
    found = []
    for name, tensor in tensors.items():
        start, size = tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes()
        found += [name for s, n in spans if start < s + n and s < start + size]
    return found


def pool_memory_never_leaves_the_pool(ctx, mesh: tuple = ()) -> dict:
    """Nothing a caller receives shares a byte with a pool allocation: the shard gradients
    value_and_grad returns (plain mode, a unit used twice), ``main_grad`` (asynchronous and
    synchronous, fused buckets), the micro-step path, the HSDP partial sums kept between
    backwards without the replicate all-reduce (a mesh with replicas), and what the upstream
    ``reduce_scatter_output()`` returns."""
    checks = {}
    variants = [("plain, a unit used twice", Run(pattern="twice", mesh=mesh), 1),
                ("main_grad asynchronous", Run(mode="main_async", mesh=mesh), 1),
                ("main_grad synchronous, fused", Run(mode="main_sync", fused=True, mesh=mesh), 1),
                ("main_grad, two micro-steps, fused", Run(mode="main_async", fused=True,
                                                          mesh=mesh), 2),
                ("plain, two micro-steps", Run(mesh=mesh), 2)]
    for label, run, micro_steps in variants:
        model, config = _build(run, ctx.world_size)
        params = model.trainable_params()
        grad_fn = ms.value_and_grad(lambda x, m=model: loss_of(m, x), None, params)
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            if mesh:       # HSDP: replicas keep their partial sums until the last micro-step
                model.set_requires_all_reduce(last)
            else:          # FSDP: micro-steps accumulate in the unit's pool buckets
                model.set_requires_gradient_sync(last)
            local, _ = _batch(micro, ctx.rank, ctx.world_size, ROWS)
            _, grads = grad_fn(ms.Tensor(local))
            pool = runtime_for(config).pool
            held = {f"{p.name} partial": p.hsdp_param.partial for p in params
                    if p.hsdp_param.partial is not None}
            if micro_steps > 1 and micro == 0 and mesh:
                checks[f"{label}: partial sums kept after micro-step 0"] = equal(
                    len(held) > 0, ctx.world_size > 1)
            held.update({f"{p.name} grad": g for p, g in zip(params, grads)})
            held.update({f"{p.name} main_grad": p.main_grad for p in params
                         if p.main_grad is not None})
            checks[f"{label}: micro-step {micro}, tensors sharing a pool bucket"] = equal(
                _sharing_a_bucket(pool, held), [])
        checks[f"{label}: buckets exist"] = equal(len(pool._buckets) > 0,   # pylint: disable=protected-access
                                                  True)
        model.zero_grad()
    model, config = _build(Run(), ctx.world_size)
    managed = model.trainable_params()[0].hsdp_param
    local, _ = _batch(0, ctx.rank, ctx.world_size, ROWS)
    full = ms.Tensor(np.ones(managed.orig_shape, np.float32))
    managed.set_unsharded_grad(full)
    managed.reduce_scatter_grad(async_op=False, reduce_op="sum")
    output = managed.reduce_scatter_output()
    checks["reduce_scatter_output(): shares a pool bucket"] = equal(
        _sharing_a_bucket(runtime_for(config).pool, {"output": output}), [])
    managed.clear_reduce_scatter_output()
    checks["reduce_scatter_output(): its values after the bucket went back"] = allclose(
        output, np_chunk(np.full(managed.orig_shape, float(ctx.world_size), np.float32),
                         managed.shard_dim, managed.rank, managed.world_size))
    return checks


suite.add("pool_memory_never_leaves_the_pool", pool_memory_never_leaves_the_pool)


@through_both_entries
def recompute_gathers_no_more(ctx, entry) -> dict:
    """A step with recompute all-gathers exactly as often as one without (the recomputed
    forward reads what the backward gathered)."""
    counts = {}
    for recompute in ("", "after", "wrapper"):
        calls = []

        def count(inner, calls=calls):
            original = inner.all_gather

            def all_gather(*args, **kwargs):
                calls.append(1)
                return original(*args, **kwargs)
            inner.all_gather = all_gather
            return inner
        with wrapped_communicators(count):
            model, _ = _build(Run(recompute=recompute, mode="main_async"), ctx.world_size)
            grad_fn = gradient_step(model, model.trainable_params(), entry)
            local, _ = _batch(0, ctx.rank, ctx.world_size, ROWS)
            grad_fn(ms.Tensor(local))
            calls.clear()
            grad_fn(ms.Tensor(local))
            counts[recompute or "none"] = len(calls)
    return {"all-gathers per step": equal(counts, {k: counts["none"] for k in counts}),
            "some all-gathers": equal(counts["none"] > 0, ctx.world_size > 1)}


def _drop_between_micro_steps(model, grad_fn, local) -> None:
    """A micro-step that does not end the optimizer step: without gradient sync the unit's
    reduce path keeps its gradients packed in pool buckets; in main_grad asynchronous mode with
    ``set_is_last_backward(False)`` each unit's reduce is left in flight."""
    model.set_requires_gradient_sync(False)
    grad_fn(local)


def _drop_after_micro_step_in_flight(model, grad_fn, local) -> None:
    model.set_is_last_backward(False)
    grad_fn(local)


def _drop_after_failed_forward(model, grad_fn, local) -> None:
    """A micro-step without sync (buckets packed), then a forward that raises, caught."""
    _drop_between_micro_steps(model, grad_fn, local)
    model.set_requires_gradient_sync(True)
    model.set_is_last_backward(False)
    FAIL["where"] = "b"
    try:
        grad_fn(local)
    except RuntimeError:
        pass
    finally:
        FAIL["where"] = None


def _drop_after_failed_backward(model, grad_fn, local) -> None:
    """A backward that raises: MindSpore's reentrant recompute of unit ``a``, refused inside
    backward after ``b``'s backward left its reduce in flight (main_grad asynchronous mode).
    Under torch-style backward MindSpore refuses it in the forward already."""
    model.set_is_last_backward(False)
    model.pattern = "recompute_fn_reentrant"
    try:
        grad_fn(local)
    except (UnsupportedPatternError, RuntimeError):
        pass


DROPS = {"between micro-steps, no gradient sync": _drop_between_micro_steps,
         "between micro-steps, not the last backward": _drop_after_micro_step_in_flight,
         "after a caught exception in forward": _drop_after_failed_forward,
         "after a caught exception in backward": _drop_after_failed_backward}


@through_both_entries
def dropped_models_return_their_leases(ctx, entry) -> dict:
    """Build, train and drop 4 models per mode in one process with the collector off, each
    dropped in the middle of an optimizer step (between micro-steps: buckets packed without
    sync, reduces left in flight) or after a caught exception in its forward or its backward:
    after each drop the pool's live leases and (idle buckets trimmed) reserved bytes are back
    at the baseline taken before the first model, and no unit of the model stays alive."""
    checks = {}
    gc.collect()
    gc.disable()
    try:
        for mode in ("plain", "main_async"):
            config = _build(Run(mode=mode), ctx.world_size)[1]
            pool = runtime_for(config).pool
            gc.collect()
            pool.trim()
            baseline = pool.stats()
            units = len(RUNTIME.live_units())
            for index, (how, drop) in enumerate(DROPS.items()):
                if entry == "backward":
                    enable_mindspore_backward_compat()   # a failure turned the grad flag off
                model, _ = _build(Run(mode=mode), ctx.world_size)
                grad_fn = gradient_step(model, model.trainable_params(), entry)
                local, _ = _batch(index, ctx.rank, ctx.world_size, ROWS)
                grad_fn(ms.Tensor(local))                 # one completed step first
                model.zero_grad()
                drop(model, grad_fn, ms.Tensor(local))
                label = f"{mode} model {index}, dropped {how}"
                # what the drop must give back: buckets packed without sync, and in main_grad
                # asynchronous mode reduces in flight (none under torch-style backward after the
                # refused recompute: MindSpore refuses it in the forward there)
                in_flight = mode == "main_async" and not (entry == "backward"
                                                          and "in backward" in how)
                checks[f"{label}: leases held before the drop"] = equal(
                    pool.stats().live_leases > baseline.live_leases,
                    in_flight or "no gradient sync" in how or "forward" in how)
                del model, grad_fn
                pool.trim()
                stats = pool.stats()
                checks[f"{label}: live leases"] = equal(stats.live_leases, baseline.live_leases)
                checks[f"{label}: reserved bytes"] = equal(stats.bytes_reserved,
                                                           baseline.bytes_reserved)
                checks[f"{label}: units alive"] = equal(len(RUNTIME.live_units()), units)
    finally:
        gc.enable()
    return checks


tied_cases.add_to(suite, MODES)


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
