"""``clip_grad_norm_`` for parameters managed by ``fully_shard``: the norm the unsharded model
would have, each gradient element counted once.

Upstream counted replicated gradients once per rank (upstream issue #735: a first-step norm of
48.47 against a 28.98 baseline). Here a sharded gradient's local shard is summed over its shard
group (its padding, past ``valid_length``, contributes nothing), HSDP replicas of a shard are not
summed again, and a replicated gradient (``replicate_params``, or a parameter fully_shard does
not manage) is counted once. A 1-D sub-mesh's shard group is assumed to be replicated by the
ranks outside it, as a 1-D mesh over part of the world is in HSDP.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import mindspore as ms
import numpy as np
from mindspore import mint

from gradpool import (InvalidArgumentError, NonFiniteNormError, check_bool, is_whole_storage,
                      overwrite)

_EPS = 1e-6


def _check(max_norm, norm_type) -> float:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                or value <= 0:
            raise InvalidArgumentError(f"{name} must be a number > 0, got {value!r}")
    if math.isinf(max_norm):
        raise InvalidArgumentError(f"max_norm must be finite, got {max_norm!r}")
    return float(norm_type)


def _valid_part(grad: ms.Tensor, managed) -> Optional[ms.Tensor]:
    """The part of this rank's shard gradient that is real parameter, not shard padding."""
    if managed is None or managed.replicate:
        return grad
    slot = managed.slot
    valid = slot.valid_length(managed.rank)
    if valid == 0:
        return None
    grad = grad.reshape(slot.chunk_shape)
    return grad if valid == slot.chunk_size else grad.narrow(slot.shard_dim, 0, valid)


_CHUNK_NUMEL = 1 << 22     # 16 MiB of float32 per fused reduction: few ops, a bounded temporary


def _shares(parts: list, norm_type: float) -> list:
    """0-d float32 device tensors, max |g| (inf) or sum |g|^p, one per run of ``parts`` joined
    into a flat tensor of at most ``_CHUNK_NUMEL`` elements: one reduction per run, not one per
    gradient, since per-op dispatch dominates for small gradients."""
    return [_share(run, norm_type) for run in _runs(parts)]


def _runs(parts: list):
    run, numel = [], 0
    for part in parts:
        if run and numel + part.numel() > _CHUNK_NUMEL:
            yield run
            run, numel = [], 0
        run.append(part.reshape(-1).astype(ms.float32))
        numel += part.numel()
    if run:
        yield run


def _share(run: list, norm_type: float) -> ms.Tensor:
    values = mint.abs(run[0] if len(run) == 1 else mint.cat(run))
    if math.isinf(norm_type):
        return mint.max(values)
    if norm_type == 2.0:
        return mint.sum(mint.square(values))
    return mint.sum(values if norm_type == 1.0 else mint.pow(values, norm_type))


def _combine(values: list, norm_type: float) -> ms.Tensor:
    """One (1,)-shaped device tensor: the max (inf) or the sum of 0-d or (1,) ``values``."""
    # cat, not stack: the CPU backend has no StackExt kernel
    stacked = mint.cat([v.reshape(1) for v in values]) if values \
        else mint.zeros(1, dtype=ms.float32)
    combined = mint.max(stacked) if math.isinf(norm_type) else mint.sum(stacked)
    return combined.reshape(1)


def _across(comm, value: ms.Tensor, norm_type: float) -> ms.Tensor:
    """``value`` ((1,) float32) summed (or, for the inf norm, maxed) over ``comm``'s ranks: one
    collective, on device."""
    if comm.world_size == 1:
        return value
    if math.isinf(norm_type):
        gathered = mint.empty(comm.world_size, dtype=ms.float32)
        comm.all_gather(gathered, value).wait()
        return mint.max(gathered).reshape(1)
    total = mint.mul(value, 1.0)        # the collective reduces in place: a tensor of its own
    comm.all_reduce(total, op="sum").wait()
    return total


def clip_grad_norm_(parameters: Iterable, max_norm: float, norm_type: float = 2.0, *,
                    grads: Optional[Sequence[ms.Tensor]] = None,
                    error_if_nonfinite: bool = False) -> ms.Tensor:
    """The total ``norm_type`` norm of the gradients of ``parameters`` (the local shards that
    ``model.trainable_params()`` gives) as if the model were unsharded; every gradient is scaled
    in place by ``min(1, max_norm / (norm + 1e-6))``.

    ``grads=None`` uses each parameter's ``main_grad`` (None: no gradient, skipped). Returns the
    norm as a 0-d float32 device tensor. Every rank must call it (it runs collectives).

    Everything runs on the gradients' device in float32, as in PyTorch: one collective per shard
    group, the clipping coefficient computed from the device-side norm, and no host read (the
    host never waits for the device here; ``float(norm.asnumpy())`` by the caller is a read of
    its own). A NaN or infinite gradient gives a NaN or infinite norm and no clipping (the
    coefficient is 1 then). ``error_if_nonfinite=True`` raises
    :class:`gradpool.errors.NonFiniteNormError` instead, before any gradient is scaled: that
    needs the norm's value on the host, so it costs one host read per call."""
    norm_type = _check(max_norm, norm_type)
    check_bool("error_if_nonfinite", error_if_nonfinite)
    params = list(parameters)
    if grads is None:
        grads = [getattr(p, "main_grad", None) for p in params]
    elif len(grads) != len(params):
        raise InvalidArgumentError(
            f"grads has {len(grads)} entries for {len(params)} parameters; give one each")
    # Asked before any op of this call is queued: a storage query on a tensor that queued ops
    # still produce waits for PyNative's launch pipeline (about 20 ms per gradient seen on a
    # loaded CPU), so the scaling below, after the norm's ops, must not ask again.
    whole = [grad is not None and is_whole_storage(grad) for grad in grads]
    replicated: list = []
    per_group: dict[int, list] = {}            # id(shard comm) -> [comm, local parts]
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        managed = getattr(param, "hsdp_param", None)
        if managed is None or managed.replicate:
            group_parts = replicated
        else:   # registered even with nothing local: every rank of the group joins its collective
            group_parts = per_group.setdefault(id(managed.comm), [managed.comm, []])[1]
        part = _valid_part(grad, managed)
        if part is not None and part.numel() > 0:
            group_parts.append(part)
    parts = [_combine(_shares(replicated, norm_type), norm_type)] + [
        _across(comm, _combine(_shares(values, norm_type), norm_type), norm_type)
        for comm, values in per_group.values()]
    combined = _combine(parts, norm_type)
    if not math.isinf(norm_type):
        combined = mint.pow(combined, 1.0 / norm_type)
    norm = combined.reshape(())
    if error_if_nonfinite:
        total = float(norm.asnumpy())           # the one host read the caller asked for
        if not math.isfinite(total):
            raise NonFiniteNormError(f"the total {norm_type:g}-norm of the gradients is {total}; "
                                     "find the NaN or infinite gradient, or pass "
                                     "error_if_nonfinite=False to skip clipping")
    _scale(grads, whole, _coefficient(norm, max_norm))
    return norm


def _coefficient(norm: ms.Tensor, max_norm: float) -> ms.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` as a 0-d float32 device tensor; 1 where ``norm`` is
    NaN or infinite (a non-finite norm clips nothing)."""
    # float(): a NumPy scalar's own division would turn the tensor into a NumPy value
    coef = mint.clamp(float(max_norm) / (norm + _EPS), max=1.0)
    # mint.ones_like has no CPU kernel: a constant made from the host value
    return mint.where(mint.isfinite(norm), coef, ms.Tensor(np.float32(1.0)))


def _scale(grads: Sequence, whole: Sequence[bool], coef: ms.Tensor) -> None:
    """Every gradient times ``coef``, written into its own memory (``Tensor.mul_`` is out of
    place on CPU): ``copy_`` into a gradient spanning its storage (``whole``), else
    :func:`gradpool.overwrite`. Always run, as PyTorch does: whether to clip is known only on the
    device, and a coefficient of 1 leaves every value as it was."""
    per_dtype = {coef.dtype: coef}     # the CPU Mul has no bfloat16 x float32 kernel: cast once
    for grad, spans in zip(grads, whole):
        if grad is None or grad.numel() == 0:
            continue
        if grad.dtype not in per_dtype:
            per_dtype[grad.dtype] = coef.astype(grad.dtype)
        scaled = mint.mul(grad, per_dtype[grad.dtype]).reshape(-1)
        if spans:
            grad.reshape(-1).copy_(scaled)
        else:
            overwrite(grad.reshape(-1), scaled)
