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

from gradpool import InvalidArgumentError, overwrite

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


def _local(grad: ms.Tensor, norm_type: float) -> float:
    values = np.abs(grad.astype(ms.float32).asnumpy().astype(np.float64))
    return float(values.max(initial=0.0)) if math.isinf(norm_type) \
        else float((values ** norm_type).sum())


def _across(comm, value: float, norm_type: float) -> float:
    """``value`` summed (or, for the inf norm, maxed) over ``comm``'s ranks."""
    if comm.world_size == 1:
        return value
    if math.isinf(norm_type):
        gathered = mint.empty(comm.world_size, dtype=ms.float32)
        comm.all_gather(gathered, ms.Tensor(np.array([value], np.float32))).wait()
        return float(gathered.asnumpy().max())
    total = ms.Tensor(np.array([value], np.float32))
    comm.all_reduce(total, op="sum").wait()
    return float(total.asnumpy()[0])


def clip_grad_norm_(parameters: Iterable, max_norm: float, norm_type: float = 2.0, *,
                    grads: Optional[Sequence[ms.Tensor]] = None) -> ms.Tensor:
    """The total ``norm_type`` norm of the gradients of ``parameters`` (the local shards that
    ``model.trainable_params()`` gives) as if the model were unsharded; when it exceeds
    ``max_norm`` every gradient is scaled in place by ``max_norm / (norm + 1e-6)``.

    ``grads=None`` uses each parameter's ``main_grad`` (None: no gradient, skipped). Returns the
    norm as a 0-d float32 tensor. Every rank must call it (it runs collectives)."""
    norm_type = _check(max_norm, norm_type)
    params = list(parameters)
    if grads is None:
        grads = [getattr(p, "main_grad", None) for p in params]
    elif len(grads) != len(params):
        raise InvalidArgumentError(
            f"grads has {len(grads)} entries for {len(params)} parameters; give one each")
    replicated = 0.0
    per_group: dict[int, list] = {}            # id(shard comm) -> [comm, local sum]
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        managed = getattr(param, "hsdp_param", None)
        part = _valid_part(grad, managed)
        if part is None or part.numel() == 0:
            local = 0.0
        else:
            local = _local(part, norm_type)
        if managed is None or managed.replicate:
            replicated = max(replicated, local) if math.isinf(norm_type) else replicated + local
            continue
        entry = per_group.setdefault(id(managed.comm), [managed.comm, 0.0])
        entry[1] = max(entry[1], local) if math.isinf(norm_type) else entry[1] + local
    parts = [replicated] + [_across(comm, value, norm_type) for comm, value in per_group.values()]
    if math.isinf(norm_type):
        total = max(parts)
    else:
        total = sum(parts) ** (1.0 / norm_type)
    coef = max_norm / (total + _EPS)
    if coef < 1.0:
        for grad in grads:
            if grad is not None:
                # mul_ is out-of-place on CPU: compute, then write into the gradient's own memory
                overwrite(grad.reshape(-1), mint.mul(grad, coef).reshape(-1))
    return ms.Tensor(np.float32(total))
