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

from gradpool import InvalidArgumentError, NonFiniteNormError, check_bool, overwrite

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
    ``model.trainable_params()`` gives) as if the model were unsharded; when it exceeds
    ``max_norm`` every gradient is scaled in place by ``max_norm / (norm + 1e-6)``.

    ``grads=None`` uses each parameter's ``main_grad`` (None: no gradient, skipped). Returns the
    norm as a 0-d float32 tensor. Every rank must call it (it runs collectives).

    The norm is computed on the gradients' device in float32: one collective per shard group and
    one host synchronisation (reading the total). A NaN or infinite gradient gives a NaN or
    infinite norm and no clipping, as in PyTorch; ``error_if_nonfinite=True`` raises
    :class:`gradpool.errors.NonFiniteNormError` instead."""
    norm_type = _check(max_norm, norm_type)
    check_bool("error_if_nonfinite", error_if_nonfinite)
    params = list(parameters)
    if grads is None:
        grads = [getattr(p, "main_grad", None) for p in params]
    elif len(grads) != len(params):
        raise InvalidArgumentError(
            f"grads has {len(grads)} entries for {len(params)} parameters; give one each")
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
    total = float(combined.asnumpy()[0])       # the call's one host synchronisation
    if error_if_nonfinite and not math.isfinite(total):
        raise NonFiniteNormError(f"the total {norm_type:g}-norm of the gradients is {total}; "
                                 "find the NaN or infinite gradient, or pass "
                                 "error_if_nonfinite=False to skip clipping")
    coef = max_norm / (total + _EPS)
    if math.isfinite(total) and coef < 1.0:     # a non-finite norm clips nothing
        for grad in grads:
            if grad is not None:
                # mul_ is out-of-place on CPU: compute, then write into the gradient's own memory
                overwrite(grad.reshape(-1), mint.mul(grad, coef).reshape(-1))
    return ms.Tensor(np.float32(total))
