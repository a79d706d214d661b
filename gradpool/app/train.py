"""Training the tiny DeepSeek-V3 model with ``fully_shard`` on the pool, and its unsharded reference.

Used by ``gradpool train`` (one process per rank under msrun), by the end-to-end tests and by the
reduce-step benchmark. The sharded and the reference run see the same global batch each
micro-step: rank ``r`` trains on rows ``r*B .. (r+1)*B-1`` and the reference on all of them
(see :func:`gradpool.app.model.make_batch_np`), so with ``reduce_op="avg"`` both take the same
optimizer steps.

The reference is an in-process single model. With ``micro_steps > 1`` it sums the micro-step
gradients before its optimizer step, which is what the sharded run's accumulation computes.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import mindspore as ms
import numpy as np
from mindspore import mint, nn

from gradpool.app.model import TinyDeepSeekV3, make_batch_np, next_token_loss
from gradpool.app.moe import ExpertParallel
from gradpool.app.config import RunConfig
from gradpool.dtypes import DTYPE_NAMES, dtype_named
from gradpool.exchange import all_sum
from gradpool.errors import GradPoolError
from gradpool.pool import PoolStats

logger = logging.getLogger(__name__)
DTYPES = {**{name: dtype_named(name) for name in DTYPE_NAMES}, None: None}


@dataclass
class StepRecord:
    step: int
    loss: float           # mean over ranks (and micro-steps) of the local mean loss
    seconds: float
    bytes_copied: int     # during this step
    copy_gbps: float
    new_allocations: int  # during this step
    high_water_bytes: int
    stall_seconds: float
    stalls: int = 0       # acquires that waited for an in-flight bucket, during this step
    saved: Optional[dict] = None   # the checkpoint saved after this step (path, bytes, seconds)


class NonFiniteLossError(GradPoolError, ArithmeticError):
    """A training loss was NaN or infinite."""


def mixed_precision(cfg: RunConfig):
    from hyper_parallel.core.fully_shard.api import MixedPrecisionPolicy
    fs = cfg.fully_shard
    return MixedPrecisionPolicy(param_dtype=DTYPES[fs.param_dtype],
                                reduce_dtype=DTYPES[fs.reduce_dtype],
                                apply_grad_on_fp32_main_grad=fs.apply_grad_on_fp32_main_grad)


def build_sharded_model(cfg: RunConfig, replicate: Callable = None,
                        shard_placement_fn: Optional[Callable] = None) -> TinyDeepSeekV3:
    """The model with ``fully_shard`` applied to each decoder layer, then to the root.

    ``replicate(model)`` may name parameters to keep whole (their gradients are all-reduced).

    With ``model.expert_parallel = E > 1`` the model holds this rank's experts only (EP groups
    of E consecutive ranks, :mod:`gradpool.app.moe`), and each layer's ``moe.experts`` is a unit
    of its own first, 1-D FSDP over the expert-data-parallel ranks (the W/E ranks with the same
    experts, also under an HSDP mesh), with gradient divide factor W (1 with reduce_op sum):
    the dispatcher already summed each expert's gradient over its EP group's E ranks. Dense
    weights stay in units ``layers.<i>`` and the root, on the configured mesh."""
    from hyper_parallel import fully_shard

    ep_mesh = expert_mesh(cfg)
    model = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed, ep=expert_parallel(cfg, ep_mesh))
    kwargs = dict(mp_policy=mixed_precision(cfg), comm_fusion=cfg.fully_shard.comm_fusion,
                  reshard_after_forward=cfg.fully_shard.reshard_after_forward,
                  pool_config=cfg.gradpool, shard_placement_fn=shard_placement_fn,
                  replicate_params=set(replicate(model)) if replicate else None,
                  mesh=device_mesh(cfg))
    if ep_mesh is not None:
        for layer in model.layers:
            fully_shard(layer.moe.experts, **{**kwargs, "mesh": ep_mesh["edp"]})
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    model.set_reduce_op_type(cfg.fully_shard.reduce_op)
    model.set_gradient_scaling_factor(cfg.fully_shard.gradient_scaling_factor)
    if ep_mesh is not None:
        factor = ep_mesh.size() if cfg.fully_shard.reduce_op == "avg" else 1
        for layer in model.layers:
            layer.moe.experts.set_gradient_divide_factor(factor)
    return model


def expert_mesh(cfg: RunConfig):
    """The (edp, ep) mesh of ``model.expert_parallel = E > 1``: W/E x E, EP groups of E
    consecutive ranks along "ep"; None for E = 1."""
    ep = cfg.model.expert_parallel
    if ep == 1:
        return None
    from gradpool import init_distributed
    from hyper_parallel import init_device_mesh
    _, world = init_distributed()
    return init_device_mesh("npu" if cfg.launch.device == "Ascend" else "cpu",
                            (world // ep, ep), mesh_dim_names=("edp", "ep"))


def expert_parallel(cfg: RunConfig, ep_mesh) -> Optional[ExpertParallel]:
    """This rank's :class:`ExpertParallel` on ``ep_mesh`` (None without one)."""
    if ep_mesh is None:
        return None
    from gradpool import runtime_for
    group = ep_mesh.get_group("ep")
    return ExpertParallel(size=ep_mesh.size("ep"), rank=ep_mesh.get_local_rank("ep"),
                          comm=runtime_for(cfg.gradpool).group_comm(group), group=group)


def device_mesh(cfg: RunConfig):
    """The configured mesh (``fully_shard.mesh_shape``), or None: shard over every rank."""
    if cfg.fully_shard.mesh_shape is None:
        return None
    from hyper_parallel import init_device_mesh
    return init_device_mesh("npu" if cfg.launch.device == "Ascend" else "cpu",
                            cfg.fully_shard.mesh_shape,
                            mesh_dim_names=cfg.fully_shard.mesh_dim_names)


def optimizer_for(cfg: RunConfig, params):
    if cfg.train.optimizer == "adam":
        return nn.Adam(params, learning_rate=cfg.train.learning_rate)
    return nn.SGD(params, learning_rate=cfg.train.learning_rate)


def _batch(cfg: RunConfig, step: int, micro: int, rank: int, world: int) -> ms.Tensor:
    index = step * cfg.train.micro_steps + micro
    return ms.Tensor(make_batch_np(cfg.model, index, rank, world, seed=cfg.train.seed))


def train_sharded(cfg: RunConfig, model, comm, pool,
                  on_step: Optional[Callable[[StepRecord], None]] = None, *,
                  optimizer=None, first_step: int = 0) -> list[StepRecord]:
    """Train ``model`` (already ``fully_shard``-ed) from step index ``first_step`` up to
    ``cfg.train.steps`` steps. ``optimizer``: one built on ``model.trainable_params()`` (a resumed
    run's, its state loaded), else a new :func:`optimizer_for`.

    A step's batches depend only on its index, so a run resumed at step k with the model and
    optimizer state of step k takes the same steps as the run that saved it."""
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda tokens: next_token_loss(model, tokens), None, params)
    if optimizer is None:
        optimizer = optimizer_for(cfg, params)
    records = []
    for step in range(first_step, cfg.train.steps):
        before = pool.stats()
        start = time.perf_counter()
        model.zero_grad()
        losses = []
        for micro in range(cfg.train.micro_steps):
            last = micro == cfg.train.micro_steps - 1
            if cfg.fully_shard.all_reduce_every_micro_step:
                model.set_requires_gradient_sync(last)      # accumulate in the unit's buckets
            else:
                model.set_requires_all_reduce(last)          # HSDP: reduce-scatter each one
            loss, grads = grad_fn(_batch(cfg, step, micro, comm.rank, comm.world_size))
            losses.append(loss)
        optimizer(optimizer_grads(cfg, params, grads))
        mean_loss = _mean_over_ranks(comm, float(np.mean([l.asnumpy() for l in losses])))
        after = pool.stats()
        record = _record(step, mean_loss, time.perf_counter() - start, before, after)
        if not math.isfinite(record.loss):
            raise NonFiniteLossError(f"step {step + 1} of {cfg.train.steps}: loss is {record.loss} "
                                     "(mean over ranks)")
        records.append(record)
        if on_step is not None:
            on_step(record)
    return records


def optimizer_grads(cfg: RunConfig, params, grads) -> tuple:
    """What the optimizer steps on: in main_grad mode each parameter's float32 ``main_grad`` (in
    the parameter's dtype), since the gradients autograd returned are zeros with the asynchronous
    reduce; otherwise autograd's gradients."""
    if not cfg.fully_shard.apply_grad_on_fp32_main_grad:
        return grads
    out = []
    for param, grad in zip(params, grads):
        main = getattr(param, "main_grad", None)
        if main is None:        # not managed by fully_shard, or no gradient reached it
            out.append(grad)
        else:
            out.append(main if main.dtype == param.dtype else main.astype(param.dtype))
    return tuple(out)


def _record(step: int, loss: float, seconds: float, before: PoolStats, after: PoolStats) -> StepRecord:
    copied = after.bytes_copied - before.bytes_copied
    copy_seconds = after.copy_seconds - before.copy_seconds
    return StepRecord(step=step, loss=loss, seconds=seconds, bytes_copied=copied,
                      copy_gbps=copied / copy_seconds / 1e9 if copy_seconds > 0 else 0.0,
                      new_allocations=after.new_allocations - before.new_allocations,
                      high_water_bytes=after.high_water_bytes,
                      stall_seconds=after.stall_seconds - before.stall_seconds,
                      stalls=after.stalls - before.stalls)


def _mean_over_ranks(comm, value: float) -> float:
    """The mean of ``value`` over ranks: their float32 sum divided in float32, as an "avg"
    all-reduce divides."""
    return float(all_sum(comm, [value])[0] / np.float32(comm.world_size))


def train_reference(cfg: RunConfig, world: int) -> tuple[list[float], dict[str, np.ndarray]]:
    """One unsharded model on the global batch: its losses and final parameters. It is the E=1
    model (dense MoE, every expert) whatever ``model.expert_parallel`` says: the expert-parallel
    model holds the same experts, split over ranks."""
    ref_cfg = replace(cfg, model=replace(cfg.model, batch_size=cfg.model.batch_size * world))
    model = TinyDeepSeekV3(replace(cfg.model, expert_parallel=1), seed=cfg.train.seed)
    params = model.trainable_params()
    grad_fn = ms.value_and_grad(lambda tokens: next_token_loss(model, tokens), None, params)
    optimizer = optimizer_for(cfg, params)
    losses = []
    for step in range(cfg.train.steps):
        total, step_losses = None, []
        for micro in range(cfg.train.micro_steps):
            loss, grads = grad_fn(_batch(ref_cfg, step, micro, 0, 1))
            step_losses.append(float(loss.asnumpy()))
            total = grads if total is None else tuple(mint.add(a, b) for a, b in zip(total, grads))
        optimizer(total)
        losses.append(float(np.mean(step_losses)))
    return losses, {p.name: p.asnumpy().copy() for p in params}


def gathered_params(model) -> dict[str, np.ndarray]:
    """Every parameter of a sharded model, all-gathered and trimmed to its full shape."""
    out = {}
    for param in model.trainable_params():
        managed = getattr(param, "hsdp_param", None)
        full = managed.unsharded(param) if managed is not None else param
        out[param.name] = full.astype(ms.float32).asnumpy().copy()
    return out
