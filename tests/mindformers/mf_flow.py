"""mindformers' own training flow on tiny models, step by step as its PyNative ``Trainer`` runs
it, and the unsharded reference it is compared with.

What runs is mindformers 2.1.0's code, called as ``mindformers.pynative.trainer.Trainer`` calls it:

- ``Trainer.__init__``: ``patch_pynative_modules()`` and ``enable_mindspore_backward_compat()``;
- ``Trainer._create_model``: ``_build_model(config)`` under ``ms.DeviceCtx("meta")``;
- ``Trainer._apply_parallelism``: ``ParallelDims.from_config`` + ``parallelize_model`` (which runs
  mindformers' ``apply_fsdp``: its ``fully_shard`` calls, placement rules, prefetch and
  ``set_reduce_op_type("sum")``);
- then ``model.to_empty()`` and ``model.init_states()`` under ``_no_grad``.

The model configs are what a mindformers YAML holds (``model:``, ``parallelism:``), passed as a
dict to ``TrainConfig.from_dict`` as ``Trainer._init_config`` does. The CPU stand-ins
(:mod:`cpu_stand_ins`) are installed first.

The reference is the same model built the same way and never parallelized, given the sharded
model's initial weights, trained in this process on the global batch (every rank's micro-batch);
the loss sense mindformers applies (``1 / world``) with its FSDP reduce op ``sum`` makes the
sharded gradient the mean over ranks of each rank's loss gradient, which is what the reference
differentiates.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

import cpu_stand_ins

cpu_stand_ins.install()     # before mindformers is imported: some of its modules bind these ops

import mindspore as ms                                                      # noqa: E402
from mindspore.graph.api import _no_grad                                    # noqa: E402

from mindformers.pynative.config import TrainConfig                         # noqa: E402
from mindformers.pynative.distributed.parallel_dims import ParallelDims     # noqa: E402
from mindformers.pynative.distributed.parallelize import parallelize_model  # noqa: E402
from mindformers.pynative.trainer.trainer import patch_pynative_modules     # noqa: E402
from mindformers.pynative.trainer.utils import _build_model                 # noqa: E402

patch_pynative_modules()    # Trainer.__init__'s first call: mindformers' non-legacy model registry

SEQ = 8
MICRO_BATCH = 2          # sequences per rank per micro-step
VOCAB = 63               # odd: the embedding and output layer are not divisible by the shard size,
                         # so mindformers' apply_fsdp hands them to fully_shard as replicate_params

# A tiny Qwen3 (mindformers' PyNativeQwen3ForCausalLM: GQA attention with q/k layernorm, SwiGLU
# MLP, RMSNorm). num_key_value_heads == num_attention_heads: mindformers' non-flash _repeat_kv
# assumes BNSD where it gets SBND (a CPU-path bug, docs/mindformers.md).
QWEN3_TINY = dict(
    model_type="qwen3", architectures="Qwen3ForCausalLM", vocab_size=VOCAB, seq_length=SEQ,
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, max_position_embeddings=64,
    num_attention_heads=4, num_key_value_heads=4, head_dim=8, hidden_act="silu",
    rms_norm_eps=1e-6, use_flash_attention=False, params_dtype="float32",
    compute_dtype="float32", layernorm_compute_dtype="float32", softmax_compute_dtype="float32",
    rotary_dtype="float32", tie_word_embeddings=False, attention_dropout=0.0,
    hidden_dropout=0.0, pad_token_id=-1)

# A tiny DeepSeek-V3 shape (mindformers' PyNativeDeepseekV3ForCausalLM: GPT with multi-latent
# attention, q and kv LoRA ranks, RoPE head dims), every layer dense (first_k_dense_replace ==
# num_hidden_layers); DEEPSEEK3_MOE_TINY below makes its second layer MoE.
DEEPSEEK3_TINY = dict(
    model_type="deepseek_v3", architectures="DeepseekV3ForCausalLM", vocab_size=VOCAB,
    seq_length=SEQ, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    max_position_embeddings=64, num_attention_heads=4, hidden_act="silu", rms_norm_eps=1e-6,
    add_bias_linear=False, use_flash_attention=False, multi_latent_attention=True,
    mla_qkv_concat=True, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8,
    qk_nope_head_dim=8, qk_layernorm=True, attention_dropout=0.0, hidden_dropout=0.0,
    params_dtype="float32", compute_dtype="float32", layernorm_compute_dtype="float32",
    softmax_compute_dtype="float32", rotary_dtype="float32", initializer_range=0.01,
    num_nextn_predict_layers=0, position_embedding_type="rope", rope_theta=10000,
    gated_linear_unit=True, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
    n_shared_experts=1, n_group=2, topk_group=1, first_k_dense_replace=2,
    moe_grouped_gemm=True, pad_token_id=-1)

# The same with its second layer a DeepSeek-V3 MoE layer (mindformers' MoELayer: TopKRouter with
# sigmoid scores, expert bias and group-limited routing, GroupedMLP experts through
# GroupedMatmul, one shared expert), run on CPU through the stand-ins of cpu_moe_stand_ins.
# 8 routed experts in 4 groups, each token routed to its top 2 experts within its top 2 groups:
# the choice depends on the scores (with 4 experts in 2 groups and 1 group chosen, a token's 2
# experts would always be a whole group). 8 experts shard evenly at 2 ranks, so mindformers'
# apply_fsdp shards the expert weights (dim 0 = experts) instead of replicating them. A micro-batch
# routes 32 entries, unevenly (1 to 11 per expert seen); experts without a token are covered by
# test_cpu_stand_ins.py and test_mindformers_moe_experts.py.
DEEPSEEK3_MOE_TINY = dict(DEEPSEEK3_TINY, first_k_dense_replace=1, n_routed_experts=8, n_group=4,
                          topk_group=2, num_experts_per_tok=2, n_shared_experts=1)


def train_config(model: dict, *, data_parallel_shard: int = -1, accumulation: int = 1,
                 max_norm: float = 0.0, recompute: Optional[str] = None) -> TrainConfig:
    """The ``TrainConfig`` a mindformers YAML with these sections gives."""
    data = {
        "training": {"local_batch_size": MICRO_BATCH, "global_batch_size": MICRO_BATCH,
                     "max_norm": max_norm, "seed": 42},
        "train_dataset": {"dataloader": {"type": "BlendedMegatronDatasetDataLoader"}},
        "optimizer": {"type": "AdamW"},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1e-3, "warmup_ratio": 0},
        "parallelism": {"data_parallel_shard": data_parallel_shard,
                        "data_parallel_shard_strategy": "optim_grads_params",
                        "disable_gradient_division": True},
        "model": dict(model),
    }
    if recompute is not None:       # "full": every decoder layer (mindformers' apply_ac)
        layers = model["num_hidden_layers"]
        data["recompute"] = {"mode": recompute, "full_recompute_layer": [f"0-{layers - 1}"]}
    cfg = TrainConfig.from_dict(data)
    cfg.accumulation = accumulation
    return cfg


def set_data_parallel(cfg: TrainConfig, world: int) -> None:
    """What ``Trainer._compute_data_parallel_size`` stores on the parallelism config."""
    par = cfg.parallelism
    par.data_parallel = world // (par.tensor_parallel * par.pipeline_parallel
                                  * par.context_parallel)
    replicate = 1 if par.data_parallel_shard < 0 else max(
        par.data_parallel // par.data_parallel_shard, 1)
    par.data_parallel_replicate = replicate
    par.data_parallel_shard = par.data_parallel // replicate


def seed(cfg: TrainConfig) -> None:
    """``Trainer._setup_seed_and_determinism``: every rank seeds MindSpore and NumPy with
    ``training.seed``, so parameters each rank initialises itself (replicated ones) agree."""
    from types import SimpleNamespace
    from mindformers.pynative.trainer.trainer import Trainer
    Trainer._setup_seed_and_determinism(SimpleNamespace(config=cfg))  # pylint: disable=protected-access


def build_on_meta(cfg: TrainConfig):
    """``Trainer._create_model`` (after ``Trainer.__init__`` seeded): the model built on the
    meta device."""
    seed(cfg)
    with ms.DeviceCtx("meta"):
        model = _build_model(cfg)
    return model


def parallelize(model, cfg: TrainConfig, world: int):
    """``Trainer._apply_parallelism``: mindformers' ParallelDims and parallelize_model."""
    set_data_parallel(cfg, world)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    parts, _, _, _ = parallelize_model(
        model=model, parallel_dims=dims, parallelism=cfg.parallelism, recompute=cfg.recompute,
        recompute_comm=cfg.recompute_comm, swap=cfg.swap,
        gradient_accumulation_steps=cfg.accumulation, forward_only=False)
    return parts[0], dims


def materialize(model) -> None:
    """``Trainer.__init__`` after parallelism: to_empty, then init_states without grad."""
    model.to_empty()
    with _no_grad():
        model.init_states()
    model.set_train(True)


# -- values ---------------------------------------------------------------------------------------
def managed(param):
    return getattr(param, "hsdp_param", None)


def full_value(param, local=None) -> np.ndarray:
    """The full (unsharded) value of ``local`` (default: the parameter itself) laid out as
    ``param``'s shard: all-gathered through the parameter's own layout when fully_shard
    manages it."""
    local = param if local is None else local
    hsdp = managed(param)
    if hsdp is not None and not hsdp.replicate:
        local = hsdp.unsharded(local)
    return np.array(local.astype(ms.float32).asnumpy(), dtype=np.float64)


_WRAPPER = "checkpoint_wrapped_module."    # recompute's wrapper cell, between a layer and its path


def canonical(path: str) -> str:
    """A parameter's path without the recompute wrapper's segment: the unwrapped model's path."""
    return path.replace(_WRAPPER, "")


def names_to_params(model) -> dict:
    """``{path: parameter}`` of the trainable parameters, paths as in the unwrapped model."""
    return {canonical(name): p for name, p in model.parameters_and_names() if p.requires_grad}


def full_state(model) -> dict[str, np.ndarray]:
    """``{path: full value}`` of every parameter, the trainable ones and the buffers mindformers
    keeps as ``requires_grad=False`` parameters (the MoE layer's ``expert_bias`` and
    ``tokens_per_expert``)."""
    return {canonical(name): full_value(p) for name, p in model.parameters_and_names()}


def load_full_state(model, state: dict[str, np.ndarray]) -> None:
    """Give the (sharded) ``model`` the full values ``state`` (this rank's rows of each)."""
    from hyper_parallel import set_model_state_dict
    paths = {canonical(name): name for name, _ in model.parameters_and_names()}
    set_model_state_dict(model, {paths[name]: ms.Tensor(values.astype(np.float32))
                                 for name, values in state.items()})


# -- data -----------------------------------------------------------------------------------------
def global_batches(steps: int, world: int, accumulation: int = 1, seed: int = 7):
    """``[step][micro][rank] -> (input_ids, labels)`` as int32 arrays; every token is a real
    token (no padding: each rank's loss averages the same number of tokens)."""
    rng = np.random.default_rng(seed)
    return [[[(rng.integers(0, VOCAB, (MICRO_BATCH, SEQ)).astype(np.int32),
               rng.integers(0, VOCAB, (MICRO_BATCH, SEQ)).astype(np.int32))
              for _ in range(world)] for _ in range(accumulation)] for _ in range(steps)]


def forward_loss(model, ids: np.ndarray, labels: np.ndarray):
    return model(input_ids=ms.Tensor(ids), labels=ms.Tensor(labels))[0].reshape(())


# -- the two trainings ----------------------------------------------------------------------------
@dataclass
class Record:
    losses: list = field(default_factory=list)        # [step][micro] this rank's loss
    grads: list = field(default_factory=list)         # [step] {name: full main_grad}
    params: dict = field(default_factory=dict)        # {name: full value} after the last step


def sgd_step(params, grads, lr: float) -> None:
    """Plain SGD on the (local) parameters: p -= lr * g."""
    for param, grad in zip(params, grads):
        ms.ops.assign(param, param - lr * grad.astype(param.dtype))


def train_sharded(model, batches, rank: int, world: int, lr: float,
                  backward: Callable) -> Record:
    """Train ``model`` (after mindformers' apply_fsdp) on this rank's micro-batches; each step's
    optimizer update reads ``main_grad`` (what mindformers' get_grad returns for a managed
    parameter). ``backward(model, ids, labels, sense)`` runs one micro-step and returns its loss."""
    named = names_to_params(model)
    params = list(named.values())
    record = Record()
    sense = 1.0 / world
    for step in batches:
        model.zero_grad()
        losses = []
        for micro in step:
            ids, labels = micro[rank]
            losses.append(float(backward(model, ids, labels, sense / len(step)).asnumpy()))
        record.losses.append(losses)
        record.grads.append({name: full_value(p, p.main_grad) for name, p in named.items()})
        sgd_step(params, [p.main_grad for p in params], lr)
    record.params = full_state(model)
    return record


def train_reference(model, batches, world: int, lr: float) -> tuple[Record, list]:
    """The unsharded model on the global batch: the gradient of the mean over ranks (and
    micro-steps) of each rank's loss. Returns the record and ``[step][micro][rank]`` losses."""
    named = names_to_params(model)
    params = list(named.values())
    record = Record()
    all_losses = []

    for step in batches:
        micro_rank = [(m, r) for m in range(len(step)) for r in range(world)]

        def objective():
            total, parts = None, []
            for m, r in micro_rank:
                ids, labels = step[m][r]
                loss = forward_loss(model, ids, labels)
                parts.append(loss)
                total = loss if total is None else total + loss
            return total / len(micro_rank), tuple(parts)

        grad_fn = ms.value_and_grad(objective, None, params, has_aux=True)
        (_, parts), grads = grad_fn()
        per = [float(p.asnumpy()) for p in parts]
        all_losses.append([[per[m * world + r] for r in range(world)] for m in range(len(step))])
        record.grads.append({name: np.array(g.asnumpy(), dtype=np.float64)
                             for name, g in zip(named, grads)})
        sgd_step(params, grads, lr)
    record.params = full_state(model)
    return record, all_losses


def backward_value_and_grad(model, ids, labels, sense):
    """One micro-step through ``ms.value_and_grad`` (the gradients land in main_grad)."""
    params = list(names_to_params(model).values())
    grad_fn = ms.value_and_grad(lambda: forward_loss(model, ids, labels) * sense, None, params)
    loss, _ = grad_fn()
    return loss / sense


def backward_torch_style(model, ids, labels, sense):
    """One micro-step as ``Trainer._forward_backward`` runs it: ``loss.backward(sense)``."""
    loss = forward_loss(model, ids, labels)
    loss.backward(ms.Tensor([sense], ms.float32).reshape(()))
    return loss
