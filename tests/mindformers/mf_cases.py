"""mindformers 2.1.0's own FSDP training on gradpool, per rank: one msrun launch per world size
runs every case (tests/mindformers/test_mindformers_distributed.py); world size 1 runs them in
pytest's process (tests/mindformers/test_mindformers_local.py).

Each case builds a tiny model through mindformers' config and model builder on the meta device,
wraps it with mindformers' own ``parallelize_model`` -> ``apply_fsdp`` over its own
``ParallelDims`` (FSDP at 1 and 2 ranks, HSDP 2 x 2 at 4 ranks: ``data_parallel_shard: 2``),
materializes it with ``to_empty()`` + ``init_states()``, and trains 3 optimizer steps from
``main_grad`` against the same model unsharded on the global batch (see :mod:`mf_flow`).

Tolerance: 1e-5 of the largest reference value per compared tensor (losses, every main_grad at
every step, every parameter after the last step). The sharded and the unsharded run differ in
summation order only (the reduce adds the ranks' gradients, the reference one backward over the
global batch): a few float32 ulps. A wrong reduce (a rank's gradient lost, a missing 1/world,
a replicate group not all-reduced) is off by tens of percent.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "distributed"))     # harness
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("LOG_MF_PATH", os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                  "gradpool-mindformers-log"))

import mindspore as ms                  # noqa: E402
import numpy as np                      # noqa: E402

from harness import Suite, allclose, equal, raises   # noqa: E402

suite = Suite("mindformers", blocking_launch=True)
STEPS = 3
LR = 0.5
RTOL = 1e-5


def _setup():
    ms.set_context(mode=ms.PYNATIVE_MODE)     # the device is the launch's (gradpool's init)
    import mf_flow
    return mf_flow


def _against(name: str, actual: np.ndarray, expected: np.ndarray) -> dict:
    """``actual`` within RTOL of the largest |expected| (absolute tolerance, per tensor)."""
    scale = float(np.abs(expected).max()) or 1.0
    return {name: allclose(actual, expected, rtol=0.0, atol=RTOL * scale)}


def compare(sharded, reference, ref_losses, rank: int) -> dict:
    """Loss of every micro-step, every main_grad at every step, every parameter after the last
    step: this rank's against the unsharded reference's."""
    checks = {}
    mine = np.array(sharded.losses, dtype=np.float64)
    want = np.array([[micro[rank] for micro in step] for step in ref_losses])
    checks.update(_against("losses", mine, want))
    checks["same_parameters"] = equal(sorted(sharded.params), sorted(reference.params))
    for step, (got, ref) in enumerate(zip(sharded.grads, reference.grads)):
        for name, values in ref.items():
            checks.update(_against(f"step{step}.main_grad.{name}", got[name], values))
    for name, values in reference.params.items():
        checks.update(_against(f"param.{name}", sharded.params[name], values))
    return checks


def _run(ctx, model_cfg, backward: str, data_parallel_shard: int = -1, check=None,
         recompute=None) -> dict:
    flow = _setup()
    world = ctx.world_size
    if backward == "loss.backward":
        from hyper_parallel.platform.mindspore.autograd_compat import (
            enable_mindspore_backward_compat)
        enable_mindspore_backward_compat()        # as Trainer.__init__ does
    cfg = flow.train_config(model_cfg, data_parallel_shard=data_parallel_shard,
                            recompute=recompute)
    model = flow.build_on_meta(cfg)
    model, dims = flow.parallelize(model, cfg, world)
    flow.materialize(model)
    reference = flow.build_on_meta(flow.train_config(model_cfg))
    flow.materialize(reference)
    # Same initial weights: the reference takes the sharded model's (gathered) initial values.
    flow.load_full_state(reference, flow.full_state(model))
    batches = flow.global_batches(STEPS, world)
    step_fn = {"value_and_grad": flow.backward_value_and_grad,
               "loss.backward": flow.backward_torch_style}[backward]
    sharded = flow.train_sharded(model, batches, ctx.rank, world, LR, step_fn)
    ref, ref_losses = flow.train_reference(reference, batches, world, LR)
    checks = compare(sharded, ref, ref_losses, ctx.rank)
    checks["mesh"] = equal(_mesh_shape(dims, world), _expected_mesh(world, data_parallel_shard))
    if check is not None:
        checks.update(check(model))
    return checks


def _mesh_shape(dims, world: int) -> list:
    """The (replicate, shard) degrees mindformers' ParallelDims derived."""
    return [dims.dp_replicate, dims.dp_shard]


def _expected_mesh(world: int, data_parallel_shard: int) -> list:
    shard = world if data_parallel_shard < 0 else data_parallel_shard
    return [world // shard, shard]


def _hsdp_shard(world: int) -> int:
    """FSDP over every rank up to 2 ranks; HSDP 2 x 2 at 4 ranks."""
    return 2 if world == 4 else -1


@suite.case
def qwen3_apply_fsdp_value_and_grad(ctx):
    return _run(ctx, _setup().QWEN3_TINY, "value_and_grad", _hsdp_shard(ctx.world_size))


@suite.case
def qwen3_apply_fsdp_loss_backward(ctx):
    """The Trainer's entry point: ``loss.backward(sense)`` after
    ``enable_mindspore_backward_compat()``."""
    return _run(ctx, _setup().QWEN3_TINY, "loss.backward", _hsdp_shard(ctx.world_size))


@suite.case
def qwen3_recompute_full_loss_backward(ctx):
    """``recompute: {mode: full}`` on every layer: mindformers' apply_ac wraps the layers with
    hyper_parallel's checkpoint_wrapper before apply_fsdp."""
    return _run(ctx, _setup().QWEN3_TINY, "loss.backward", _hsdp_shard(ctx.world_size),
                recompute="full", check=_every_layer_checkpointed)


def _every_layer_checkpointed(model) -> dict:
    wrapped = [name for name, cell in model.cells_and_names()
               if hasattr(cell, "checkpoint_wrapped_module")
               and "checkpoint_wrapped_module" in cell.__dict__.get("_cells", {})]
    return {"layers_checkpointed": equal(wrapped, ["model.decoder.layers.0",
                                                   "model.decoder.layers.1"])}


def _seed_settings(model) -> dict:
    """The configuration of the original crash, as mindformers' apply_fsdp set it up: float32
    parameters, reduce_dtype float32, the reduced gradient accumulated on a float32 main_grad;
    and gradpool's integrity check: every caller gradient proven unchanged after its reduce
    (one per managed parameter per step)."""
    flow = _setup()
    named = flow.names_to_params(model)
    hsdp = {name: flow.managed(p) for name, p in named.items()}
    return {
        "every_parameter_managed": equal(sorted(n for n, h in hsdp.items() if h is None), []),
        "float32_parameters": equal(sorted({str(p.dtype) for p in named.values()}), ["Float32"]),
        "reduce_dtype_float32": equal(sorted({str(h.reduce_dtype) for h in hsdp.values()}),
                                      ["Float32"]),
        "fp32_main_grad": equal(sorted({h.use_main_grad for h in hsdp.values()}), [True]),
        "gradients_verified_unchanged": equal(
            {name: h.verified_gradients for name, h in hsdp.items()},
            {name: STEPS for name in hsdp}),
    }


def _run_verified(ctx, model_cfg: dict, check) -> dict:
    from gradpool import GradPoolConfig, set_default_pool_config
    # mindformers' apply_fsdp calls fully_shard without pool_config: the default carries it.
    previous = set_default_pool_config(GradPoolConfig(verify_gradients=True))
    try:
        return _run(ctx, model_cfg, "value_and_grad", check=check)
    finally:
        set_default_pool_config(previous)


@suite.case
def deepseek3_mla_seed_settings_verified(ctx):
    return _run_verified(ctx, _setup().DEEPSEEK3_TINY, _seed_settings)


_MOE = "model.decoder.layers.1.mlp."


def _moe_layer_and_seed_settings(model, shard: int) -> dict:
    """The seed's settings (above) on the MoE model, and that mindformers built the second
    layer as its MoELayer and its apply_fsdp at expert parallel 1 sharded the routed experts'
    weights along the expert dim (each rank holds ``experts / shard`` of them)."""
    flow = _setup()
    named = flow.names_to_params(model)
    layer = model.model.decoder.layers[1].mlp
    experts = flow.DEEPSEEK3_MOE_TINY["n_routed_experts"]
    checks = _seed_settings(model)
    checks["moe_layer"] = equal(
        [type(layer).__name__, type(layer.experts).__name__, layer.shared_experts is not None],
        ["MoELayer", "GroupedMLP", True])
    for name in ("experts.weight1", "experts.weight2", "router.weight"):
        param = named[_MOE + name]
        checks[f"sharded.{name}"] = equal(
            [flow.managed(param).replicate, int(param.shape[0])], [False, experts // shard])
    return checks


@suite.case
def deepseek3_moe_seed_settings_verified(ctx):
    """mindformers' DeepSeek-V3 MoE layer (router, grouped-GEMM experts, shared expert) on
    CPU through the stand-ins, trained with the seed's settings at expert parallel 1."""
    shard = _expected_mesh(ctx.world_size, -1)[1]
    return _run_verified(ctx, _setup().DEEPSEEK3_MOE_TINY,
                         lambda model: _moe_layer_and_seed_settings(model, shard))


# -- mindformers' Trainer step ---------------------------------------------------------------------
def _trainer_step(ctx, max_norm: float) -> dict:
    """``Trainer.training_step`` 3 times (2 micro-batches each: gradient accumulation through
    main_grad, ``loss.backward(sense)``, grad norm, clipping at ``max_norm``, AdamW from
    main_grad, ``zero_grad``) against the same Trainer methods on the unsharded model in this
    process (its single-card path: ``param.grad``, no FSDP) stepping on the whole global batch
    in one micro-batch.

    The reference takes no micro-steps on purpose: under torch-style backward on MindSpore 2.10
    a ``param.grad`` accumulated over two ``backward()`` calls is wrong for a weight used
    transposed (every mindformers ``Linear``); the sharded side's accumulation goes through
    ``main_grad`` and is what is tested here."""
    flow = _setup()
    import mf_trainer
    world, accumulation = ctx.world_size, 2
    shard = _hsdp_shard(world)
    batches = flow.global_batches(STEPS, world, accumulation)
    cfg = mf_trainer.trainer_config(flow.QWEN3_TINY, world, flow.MICRO_BATCH, accumulation,
                                    max_norm, lr=1e-2, data_parallel_shard=shard)
    sharded = mf_trainer.TrainerUnderTest(
        cfg, flow.build_on_meta(cfg), world,
        [[micro[ctx.rank] for micro in step] for step in batches], parallel=True)
    initial = flow.full_state(sharded.model[0])
    ref_cfg = mf_trainer.trainer_config(flow.QWEN3_TINY, 1,
                                        flow.MICRO_BATCH * world * accumulation, 1, max_norm,
                                        lr=1e-2)
    reference = mf_trainer.TrainerUnderTest(
        ref_cfg, flow.build_on_meta(ref_cfg), 1, mf_trainer.reference_batches(batches, world),
        parallel=False, initial_state=initial)
    losses, norms = mf_trainer.run_steps(sharded, STEPS)
    ref_losses, ref_norms = mf_trainer.run_steps(reference, STEPS)
    checks = {"accumulation_steps": equal([sharded.num_accumulation_steps,
                                           reference.num_accumulation_steps], [accumulation, 1])}
    checks.update(_against("losses", np.array(losses), np.array(ref_losses)))
    checks.update(_against("grad_norms", np.array(norms), np.array(ref_norms)))
    final, ref_final = flow.full_state(sharded.model[0]), flow.full_state(reference.model[0])
    for name, values in ref_final.items():
        checks.update(_against(f"param.{name}", final[name], values))
    return checks


@suite.case
def trainer_step_accumulate_norm_adamw(ctx):
    return _trainer_step(ctx, max_norm=1e6)     # the norm is computed, no clipping


@suite.case
def trainer_grad_norm_clips_main_grad(ctx):
    """Clipping, as ``Trainer._optimizer_update`` runs it: after two micro-steps of
    ``Trainer._forward_backward`` (``loss.backward(sense)``), ``_calculate_global_grad_norm``
    over the optimizer's parameters (``get_grad`` = main_grad, each a DTensor whose Replicate
    dims divide its share of the norm) gives the unsharded model's global norm, and scales every
    main_grad in place by ``max_norm / (norm + 1e-6)``."""
    flow = _setup()
    import mf_trainer
    from mindformers.pynative.trainer.utils import _calculate_global_grad_norm
    world, accumulation, max_norm = ctx.world_size, 2, 0.25
    batches = flow.global_batches(1, world, accumulation)
    cfg = mf_trainer.trainer_config(flow.QWEN3_TINY, world, flow.MICRO_BATCH, accumulation,
                                    max_norm, lr=1e-2, data_parallel_shard=_hsdp_shard(world))
    trainer = mf_trainer.TrainerUnderTest(
        cfg, flow.build_on_meta(cfg), world, [[m[ctx.rank] for m in batches[0]]],
        parallel=True)
    reference = flow.build_on_meta(flow.train_config(flow.QWEN3_TINY))
    flow.materialize(reference)
    flow.load_full_state(reference, flow.full_state(trainer.model[0]))
    ref_grads = _reference_grads(flow, reference, batches[0], world)
    from hyper_parallel.platform.mindspore.autograd_compat import (
        enable_mindspore_backward_compat)
    enable_mindspore_backward_compat()      # value_and_grad above turned the grad flag off
    for micro in range(accumulation):
        trainer._set_requires_all_reduce(micro == accumulation - 1)   # pylint: disable=protected-access
        trainer._forward_backward(trainer.model, trainer._next_batch())  # pylint: disable=protected-access
    norm, _ = _calculate_global_grad_norm(trainer.optimizer.parameters,
                                          enable_parallel=True, max_norm=max_norm)
    ref_norm = float(np.sqrt(sum(float((g ** 2).sum()) for g in ref_grads.values())))
    coef = max_norm / (ref_norm + 1e-6)
    checks = {"clipped": equal(coef < 1, True)}
    checks.update(_against("global_norm", np.array([float(norm.asnumpy())]),
                           np.array([ref_norm])))
    for name, param in flow.names_to_params(trainer.model[0]).items():
        checks.update(_against(f"clipped_main_grad.{name}",
                               flow.full_value(param, param.main_grad), ref_grads[name] * coef))
    return checks


def _reference_grads(flow, reference, step, world: int) -> dict:
    """The unsharded gradient of the mean over micro-steps and ranks of each one's loss."""
    named = flow.names_to_params(reference)
    pairs = [micro[r] for micro in step for r in range(world)]

    def objective():
        total = None
        for ids, labels in pairs:
            loss = flow.forward_loss(reference, ids, labels)
            total = loss if total is None else total + loss
        return total / len(pairs)

    _, grads = ms.value_and_grad(objective, None, list(named.values()))()
    return {name: np.array(g.asnumpy(), dtype=np.float64) for name, g in zip(named, grads)}


# -- refused by name ----------------------------------------------------------------------------
# Not at world size 1: the Trainer applies FSDP only when world_size > 1 (its single-card path is
# the reference of the Trainer case), and EP/TP of degree 1 is no parallelism to refuse.
MULTI_RANK_ONLY = {"trainer_step_accumulate_norm_adamw", "trainer_grad_norm_clips_main_grad",
                   "expert_parallel_refused_by_name", "tensor_parallel_refused_by_name"}


def _refused(ctx, model_cfg: dict, **parallelism) -> dict:
    """mindformers' parallelize_model with a parallelism gradpool does not provide: a typed
    error naming the feature, raised while mindformers applies it (before any training)."""
    flow = _setup()
    cfg = flow.train_config(model_cfg)
    for key, value in parallelism.items():
        setattr(cfg.parallelism, key, value)
    model = flow.build_on_meta(cfg)
    return {"refused": raises(_feature_error(), lambda: flow.parallelize(model, cfg,
                                                                          ctx.world_size),
                              "is not provided", "FSDP/HSDP")}


def _feature_error():
    from gradpool import FeatureNotProvidedError
    return FeatureNotProvidedError


@suite.case
def expert_parallel_refused_by_name(ctx):
    """mindformers' ExpertParallel places expert weights with distribute_tensor over its EP
    mesh: refused while mindformers parallelizes the model (built on meta), before any training.
    At expert parallel 1 the same MoE layers train (deepseek3_moe_seed_settings_verified)."""
    moe = dict(_setup().DEEPSEEK3_TINY, first_k_dense_replace=1)
    return _refused(ctx, moe, expert_parallel=ctx.world_size)


@suite.case
def tensor_parallel_refused_by_name(ctx):
    return _refused(ctx, _setup().QWEN3_TINY, tensor_parallel=ctx.world_size)


if __name__ == "__main__":
    suite.main()
