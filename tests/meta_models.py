"""A model initialised the way mindformers' Trainer initialises one, for the meta-device tests
(tests/test_meta_init.py in-process, tests/distributed/meshmeta_cases*.py on msrun ranks).

* :class:`Linear` / :class:`Norm` have mindformers' ``reset_parameter`` (``weight.normal_(mean=0,
  std=0.01)``, ``bias.zero_()``, ``weight.fill_(1.0)``) and its ``mint.empty`` parameters.
* :func:`cpu_initialisers`: MindSpore 2.10 has no CPU kernel for ``InplaceNormal``,
  ``InplaceZero`` or ``InplaceFillScalar``; within it ``Tensor.normal_`` / ``zero_`` / ``fill_``
  are test stand-ins drawing from NumPy's global generator (seeded by the test), written with
  ``Tensor.copy_``. ``normal_`` is marked ``continues_across_calls`` (a sharded parameter is
  drawn block by block) unless ``block_by_block=False`` (the full draw MindSpore's own op gets). Both the unsharded reference and the sharded model run the same stand-ins,
  so what is compared is how an initialiser of the full parameter reaches the local shards.
* :func:`build_meta` is the Trainer's order: build under ``DeviceCtx("meta")``, ``fully_shard``
  each block inside that context, ``to_empty()``, ``init_states()`` under no-grad.
"""
from __future__ import annotations

import contextlib

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn
from mindspore.graph.api import _no_grad

from hyper_parallel import fully_shard
from hyper_parallel.core.fully_shard.utils import MixedPrecisionPolicy
from hyper_parallel.platform.mindspore.fully_shard.meta_init import continues_across_calls

MAIN_GRAD = MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)


@contextlib.contextmanager
def cpu_initialisers(block_by_block: bool = True, draws: list | None = None):
    """``block_by_block``: mark the ``normal_`` stand-in ``continues_across_calls`` (true of it:
    consecutive legacy NumPy draws continue one stream). ``draws``: each tensor size the stand-in
    ``normal_`` fills is appended to it."""
    def normal_(self, mean=0.0, std=1.0, generator=None):
        if draws is not None:
            draws.append(int(np.prod(self.shape)))
        return _write(self, np.random.normal(mean, std, self.shape))

    if block_by_block:
        continues_across_calls(normal_)

    def fill_(self, value):
        return _write(self, np.full(self.shape, value))

    def zero_(self):
        return _write(self, np.zeros(self.shape))

    saved = {name: ms.Tensor.__dict__.get(name) for name in ("normal_", "fill_", "zero_")}
    ms.Tensor.normal_, ms.Tensor.fill_, ms.Tensor.zero_ = normal_, fill_, zero_
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(ms.Tensor, name)
            else:
                setattr(ms.Tensor, name, method)


def _write(tensor, values: np.ndarray):
    ms.Tensor.copy_(tensor, ms.Tensor(values.astype(np.float32)).astype(tensor.dtype))
    return tensor


class Linear(nn.Cell):
    def __init__(self, in_features: int, out_features: int, dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(mint.empty((out_features, in_features), dtype=dtype),
                                name="weight")
        self.bias = Parameter(mint.empty((out_features,), dtype=dtype), name="bias")

    def construct(self, x):
        return mint.matmul(x, self.weight.T.astype(x.dtype)) + self.bias.astype(x.dtype)

    def reset_parameter(self):
        self.weight.normal_(mean=0.0, std=0.01)
        self.bias.zero_()


class Norm(nn.Cell):
    def __init__(self, size: int):
        super().__init__()
        self.weight = Parameter(mint.empty((size,)), name="weight")

    def construct(self, x):
        return x * self.weight

    def reset_parameter(self):
        self.weight.fill_(1.0)


class Block(nn.Cell):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.up = Linear(width, hidden)
        self.down = Linear(hidden, width)
        self.norm = Norm(width)

    def construct(self, x):
        return self.norm(x + self.down(mint.tanh(self.up(x))))


class Net(nn.Cell):
    """Uneven shards at 2 ranks: vocab 11 and hidden 7 rows split 6 + 5 and 4 + 3."""

    def __init__(self, vocab: int = 11, width: int = 6, hidden: int = 7, layers: int = 2):
        super().__init__()
        self.embed = Linear(vocab, width)
        self.layers = nn.CellList([Block(width, hidden) for _ in range(layers)])
        self.head = Linear(width, vocab)

    def construct(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)

    def init_states(self):
        for _, cell in self.cells_and_names():
            if hasattr(cell, "reset_parameter"):
                cell.reset_parameter()


def shard(net: Net, mesh=None, placement=None) -> Net:
    """apply_fsdp's shape: each block its unit, the head its own, the root last
    (``placement``: fully_shard's ``shard_placement_fn``)."""
    for block in net.layers:
        fully_shard(block, mesh=mesh, mp_policy=MAIN_GRAD, shard_placement_fn=placement)
    fully_shard(net.head, mesh=mesh, mp_policy=MAIN_GRAD, shard_placement_fn=placement)
    fully_shard(net, mesh=mesh, mp_policy=MAIN_GRAD, shard_placement_fn=placement)
    return net


def build_reference(seed: int, **sizes) -> Net:
    """Built on the real device and initialised whole (then sharded by the caller)."""
    np.random.seed(seed)
    net = Net(**sizes)
    with _no_grad():
        net.init_states()
    return net


def build_meta(seed: int, mesh=None, placement=None, **sizes) -> Net:
    """mindformers' Trainer order: meta build, fully_shard inside the meta context,
    ``to_empty()``, ``init_states()`` under no-grad."""
    with ms.DeviceCtx("meta"):
        net = Net(**sizes)
        shard(net, mesh, placement)
    net.to_empty()
    np.random.seed(seed)
    with _no_grad():
        net.init_states()
    return net


def local_values(net: Net) -> dict:
    """name -> a host copy of the local shard of every trainable parameter."""
    return {p.name: np.array(p.asnumpy()) for p in net.trainable_params()}
