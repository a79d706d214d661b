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
  (``normal_``, ``uniform_``, ``fill_``, ``zero_`` ...) initialises the *full* parameter's values
  and keeps this rank's chunk, so a seed gives the same local shards as initialising the
  unsharded model and sharding it. Each rank runs every random draw of the model, in the order
  the model initialises its parameters, and keeps its chunk:

  - an initialiser marked :func:`continues_across_calls` (its consecutive calls on the pieces of
    a tensor continue one random stream) is drawn in consecutive flat blocks of at most the local
    chunk and at most :data:`BLOCK_BYTES` (:mod:`.block_draw`); every block is drawn, so the
    stream ends where one full draw would, and no rank holds the full parameter;
  - any other, MindSpore 2.10's own random in-place ops included, draws the full parameter
    (transient, one at a time: the peak is a few copies of the largest parameter, never the
    model). MindSpore's ops cannot be entered part-way: each call takes one ``(seed, offset)``
    from the generator, whose offset advances by 12 whatever the tensor's size (measured at 4,
    4000 and 400000 elements), and the kernel has no element-offset argument, so a second
    block's call is keyed like a second parameter, not like the rest of the first. On CPU none
    of them runs (``InplaceNormal``, ``InplaceUniform``, ``InplaceRandom``: no kernel;
    ``exponential_``: not implemented; ``bernoulli_``: not supported on the device;
    ``log_normal_``, ``cauchy_``, ``geometric_``: not Tensor methods). Logged once per op.

  Measured at 4 CPU ranks, 104 MiB float32 model, largest parameter 16 MiB
  (tests/distributed/meshmeta_cases_4.py, peak resident memory): init peaks at 37.5 MiB per rank
  block by block (local shards 26 + 11.5 transient; main_grad is made when a gradient lands);
  with full draws it peaked at 132.1 MiB (main_grad's 26 MiB of zeros included then);
  the largest tensor an initialiser fills is one 1 MiB block. Constant initialisers write only
  the chunk. Padding rows of an uneven last shard stay zero.
* :func:`refuse_meta_at_forward`: a unit whose parameters are still on meta when its forward
  starts refuses them by name.
"""
from __future__ import annotations

import logging
from typing import Iterable

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint

from gradpool import MetaDeviceError, itemsize, on_real_device
from hyper_parallel.platform.mindspore.fully_shard.block_draw import blocks, chunk_runs

logger = logging.getLogger(__name__)

META = "meta"
# in-place initialisers that draw from a random stream: every value is drawn (block by block or
# whole, see the module doc), this rank's chunk kept
RANDOM_INITIALISERS = ("normal_", "uniform_", "random_", "exponential_", "log_normal_",
                       "cauchy_", "geometric_", "bernoulli_")
# constant ones: the chunk alone is written
CONSTANT_INITIALISERS = ("fill_", "zero_")
# a block drawn by an initialiser marked continues_across_calls holds at most this many bytes
BLOCK_BYTES = 1 << 20
_CONTINUES = "continues_across_calls"
_SHARED_HOST = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


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


def continues_across_calls(initialiser):
    """Mark the in-place random ``initialiser`` (a ``Tensor`` method such as ``normal_``) as
    continuing its random stream across calls: called on consecutive pieces of a tensor (its
    elements in row-major order), it gives exactly the values one call on the whole tensor gives
    and leaves its random state where that call would (a draw from NumPy's global generator
    does). A sharded parameter is then drawn block by block and no rank holds the full
    parameter. Unmarked initialisers, MindSpore's own included, draw the full parameter (see the
    module doc). Returns ``initialiser``."""
    setattr(initialiser, _CONTINUES, True)
    return initialiser


def draws_block_by_block(initialiser) -> bool:
    """``initialiser`` was marked with :func:`continues_across_calls`."""
    return bool(getattr(initialiser, _CONTINUES, False))


def _random_initialiser(managed, name: str):
    def initialise(*args, **kwargs):
        local = _materialised(managed, name)
        method = getattr(ms.Tensor, name)     # the op the unsharded init runs
        with on_real_device():
            if draws_block_by_block(method):
                chunk = _drawn_block_by_block(managed, method, args, kwargs)
            else:
                _log_full_draw(name)
                chunk = _drawn_whole(managed, method, args, kwargs)
            _write(local, chunk)
        return local
    initialise.__name__ = name
    return initialise


def _drawn_whole(managed, method, args, kwargs) -> np.ndarray:
    full = mint.empty(managed.orig_shape, dtype=managed.orig_dtype)     # transient
    method(full, *args, **kwargs)
    return host_shard_values(full, managed.slot, managed.rank)


def _drawn_block_by_block(managed, method, args, kwargs) -> np.ndarray:
    """Every block of the parameter is drawn in order (the stream advances as one full draw
    would, so the next parameter's values are right too); only this rank's elements are kept."""
    slot = managed.slot
    size = block_numel(slot, itemsize(managed.orig_dtype))
    runs = chunk_runs(slot.shape, slot.shard_dim, slot.chunk_size, managed.rank)
    chunk = None           # (a parameter has at least one element: layout.py refuses empty)
    buffers = {}           # block length -> the tensor drawn into (at most two lengths)
    for block in blocks(slot.numel, size, runs):
        tensor = buffers.get(block.length)
        if tensor is None:
            tensor = buffers[block.length] = mint.empty((block.length,),
                                                        dtype=managed.orig_dtype)
        method(tensor, *args, **kwargs)
        values = tensor.asnumpy()          # on CPU the tensor's own memory: copied out below
        if chunk is None:
            chunk = np.zeros(slot.chunk_numel, dtype=values.dtype)
        for at, to, length in block.keep:
            chunk[to:to + length] = values[at:at + length]
    return chunk.reshape(slot.chunk_shape)


def block_numel(slot, item_bytes: int) -> int:
    """Elements per block: at most this rank's chunk (so below the full parameter from 2 ranks
    on) and at most :data:`BLOCK_BYTES`."""
    return max(1, min(slot.chunk_numel, BLOCK_BYTES // item_bytes))


_FULL_DRAW_LOGGED: set = set()


def _log_full_draw(name: str) -> None:
    if name not in _FULL_DRAW_LOGGED:
        _FULL_DRAW_LOGGED.add(name)
        logger.info(
            "Tensor.%s on a sharded parameter draws the full parameter on each rank (one at a "
            "time) and keeps this rank's chunk: it is not marked continues_across_calls, and "
            "MindSpore's own random in-place ops draw each call from one (seed, offset) and "
            "cannot be entered part-way", name)


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
    # NumPy's own dtypes: the tensor shares the array's memory (no second chunk-sized copy)
    value = ms.Tensor.from_numpy(chunk) if chunk.dtype in _SHARED_HOST else ms.Tensor(chunk)
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
