"""hyper_parallel.core.activation_checkpoint under fully_shard, in this process: ``context_fn``
reaches MindSpore's recompute (its first context around the forward, its second around the
re-run in backward), and the gradients equal the same model without recompute."""
import contextlib

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint, nn

from hyper_parallel import fully_shard
from hyper_parallel.core.activation_checkpoint import checkpoint, is_recomputing


class Block(nn.Cell):
    def __init__(self, seed: int):
        super().__init__()
        w = np.random.default_rng(seed).standard_normal((6, 6)).astype(np.float32) * .5
        self.w = Parameter(ms.Tensor(w), name=f"w{seed}")

    def construct(self, x):
        return mint.tanh(mint.matmul(x, self.w))


class Net(nn.Cell):
    def __init__(self, context_fn=None):
        super().__init__()
        self.first, self.second = Block(1), Block(2)
        self.context_fn = context_fn

    def construct(self, x):
        h = self.first(x)
        if self.context_fn is not None:
            h = checkpoint(self.second, h, context_fn=self.context_fn)
        else:
            h = self.second(h)
        return (h * h).mean()


def test_context_fn_enters_its_contexts_around_the_forward_and_the_recompute():
    entered = []

    @contextlib.contextmanager
    def recording(label):
        entered.append((label, is_recomputing()))
        yield

    model = Net(lambda: (recording("forward"), recording("recompute")))
    fully_shard(model.second)
    fully_shard(model)
    ref = Net()
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32))
    _, grads = ms.value_and_grad(model, None, model.trainable_params())(x)
    _, want = ms.value_and_grad(ref, None, ref.trainable_params())(x)
    assert entered == [("forward", False), ("recompute", True)]
    for got, expected in zip(grads, want):
        np.testing.assert_allclose(got.asnumpy(), expected.asnumpy(), rtol=1e-6, atol=1e-7)
