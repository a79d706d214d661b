"""Meta-device initialisation of ``fully_shard``-managed parameters (mindformers' Trainer flow):

    with ms.DeviceCtx("meta"):
        model = build()                 # parameters have shapes, no memory
        fully_shard(layer) ...          # records the sharding; each shard is a meta Parameter
    model.to_empty()                    # each managed parameter gets its local shard's memory
    with _no_grad():
        model.init_states()             # reset_parameter(): weight.normal_(), bias.zero_() ...

* :func:`meta_shard`: the local shard of a meta parameter is a meta Parameter of the local
  shape: nothing is allocated, nothing read.
* ``HSDPModule.to_empty()`` allocates on the process's real device (MindSpore 2.10's
  ``Cell.to_empty()`` without a device keeps a meta tensor on meta).
* :func:`install_sharded_init`: an in-place initialiser called on a sharded parameter
  (``normal_``, ``uniform_``, ``fill_``, ``zero_`` ...) initialises the *full* parameter and
  keeps this rank's chunk, so a seed gives the same local shards as initialising the unsharded
  model and sharding it. A random one has to draw the full tensor for that: a random stream
  cannot be entered at a shard's offset, so each rank draws the whole parameter, in the order
  the model initialises them, and keeps its chunk. That full tensor is transient and one at a
  time (peak: the largest parameter, never the model); constant initialisers write only the
  chunk. Padding rows of an uneven last shard stay zero.
* :func:`refuse_meta_at_forward`: a unit whose parameters are still on meta when its forward
  starts refuses them by name.
"""
from __future__ import annotations

import logging
from typing import Iterable

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint

from gradpool import MetaDeviceError, on_real_device

logger = logging.getLogger(__name__)

META = "meta"
# in-place initialisers that draw from a random stream: the full tensor is drawn, the chunk kept
RANDOM_INITIALISERS = ("normal_", "uniform_", "random_", "exponential_", "log_normal_",
                       "cauchy_", "geometric_", "bernoulli_")
# constant ones: the chunk alone is written
CONSTANT_INITIALISERS = ("fill_", "zero_")


def is_meta(tensor) -> bool:
    """``tensor`` lives on the meta device (a shape without memory)."""
    return getattr(tensor, "device", None) == META


def meta_shard(param: Parameter, local_shape: tuple) -> Parameter:
    """The local shard of meta parameter ``param``: a meta Parameter of ``local_shape`` (the
    memory comes with ``to_empty()``)."""
    with ms.DeviceCtx(META):
        local = mint.empty(local_shape, dtype=param.dtype)
    return Parameter(local, name=param.name, requires_grad=param.requires_grad)


def install_sharded_init(managed) -> None:
    """Make the in-place initialisers of ``managed``'s local shard initialise the full parameter
    and keep this rank's chunk (see the module doc). Bound on the shard object itself: the
    Parameter the optimizer holds stays the same object."""
    local = managed.sharded_param
    for name in RANDOM_INITIALISERS:
        setattr(local, name, _random_initialiser(managed, name))
    for name in CONSTANT_INITIALISERS:
        setattr(local, name, _constant_initialiser(managed, name))


def _random_initialiser(managed, name: str):
    def initialise(*args, **kwargs):
        local = _materialised(managed, name)
        with on_real_device():
            full = mint.empty(managed.orig_shape, dtype=managed.orig_dtype)   # transient
            getattr(ms.Tensor, name)(full, *args, **kwargs)   # the op the unsharded init runs
            chunk = host_shard_values(full, managed.slot, managed.rank)
            del full
            _write(local, chunk)
        return local
    initialise.__name__ = name
    return initialise


def _constant_initialiser(managed, name: str):
    def initialise(*args, **kwargs):
        local = _materialised(managed, name)
        value = 0 if name == "zero_" else _fill_value(*args, **kwargs)
        chunk = np.zeros(managed.local_shape, dtype=_host_dtype(local.dtype))
        chunk[valid_index(managed.slot, managed.rank)] = value
        with on_real_device():
            _write(local, chunk)
        return local
    initialise.__name__ = name
    return initialise


def _fill_value(value=None, **kwargs):
    value = kwargs.get("value", value)
    if isinstance(value, ms.Tensor):
        value = value.asnumpy().item()
    return value


def _materialised(managed, name: str) -> Parameter:
    local = managed.sharded_param
    if is_meta(local):
        raise MetaDeviceError(
            f"{managed.name}.{name}(): the parameter is still on the meta device; call "
            "model.to_empty() before initialising it")
    return local


def _host_dtype(dtype) -> np.dtype:
    # bfloat16 has no NumPy dtype of its own: written as float32, cast on the way in
    return np.float16 if dtype == ms.float16 else np.float64 if dtype == ms.float64 \
        else np.float32


def valid_index(slot, rank: int, start: int = 0) -> tuple:
    """Index of the real (unpadded) rows of ``rank``'s chunk: in the full tensor when ``start``
    is the chunk's offset there, in the chunk when it is 0."""
    index = [slice(None)] * len(slot.shape)
    index[slot.shard_dim] = slice(start, start + slot.valid_length(rank))
    return tuple(index)


def host_shard_values(full: ms.Tensor, slot, rank: int) -> np.ndarray:
    """``rank``'s chunk of ``full``, zero-padded to the chunk shape, as a host array."""
    values = full.asnumpy()
    chunk = np.zeros(slot.chunk_shape, dtype=values.dtype)
    chunk[valid_index(slot, rank)] = values[valid_index(slot, rank, rank * slot.chunk_size)]
    return chunk


def _write(local: Parameter, chunk: np.ndarray) -> None:
    """``chunk`` into the shard's own memory (the class's ``copy_``: a whole tensor at offset 0,
    which writes through on every backend)."""
    value = ms.Tensor(chunk)
    if value.dtype != local.dtype:
        value = value.astype(local.dtype)
    ms.Tensor.copy_(local, value)


def refuse_meta_at_forward(modules: list, params: list) -> None:
    """Before the first forward of ``modules`` (one unit), refuse by name the parameters of
    ``params`` built on meta whose shard is still there. Registered before the unit's own
    forward pre-hook, so it runs first; once every shard has memory it checks nothing more (a
    hook cannot remove itself while MindSpore runs the hooks)."""
    pending = [p for p in params if p.built_on_meta]
    if not pending:
        return

    def check(cell, inputs):
        if pending:
            refuse_meta(pending)
            pending.clear()

    for module in modules:
        module.register_forward_pre_hook(check)


def refuse_meta(params: Iterable) -> None:
    """Raise :class:`gradpool.MetaDeviceError` naming the managed parameters in ``params``
    whose local shard is still on the meta device (a forward cannot run on them)."""
    left = [p.name for p in params if is_meta(p.sharded_param)]
    if left:
        shown = ", ".join(left[:8]) + (f" and {len(left) - 8} more" if len(left) > 8 else "")
        raise MetaDeviceError(
            f"{len(left)} fully_shard parameter(s) are still on the meta device at a forward: "
            f"{shown}; call model.to_empty() and initialise them (e.g. model.init_states()) "
            "before the first forward")
