"""Training patterns (tests/distributed/pattern_cases.py) at world size 1, in this process: the
values against the unsharded model where a shard is the whole parameter (the 2-rank launch,
tests/test_patterns_distributed.py, is where uneven shards and real collectives are)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))

import harness          # noqa: E402
import pattern_cases    # noqa: E402


@pytest.mark.parametrize("name", pattern_cases.suite.names)
def test_pattern_at_world_size_1(name, tmp_path):
    pattern_cases.suite.main([str(tmp_path), name])     # outside msrun: single process
    results = harness.load_results(tmp_path, pattern_cases.suite.name, nproc=1)
    results.verify(name)


def test_checkpoint_wrapper_takes_context_fn_and_shows_the_wrapped_module():
    """What mindformers' apply_ac needs of checkpoint_wrapper: ``context_fn`` (its two context
    managers entered around the forward and around the recompute in backward), ``early_stop``,
    and the wrapped module's attributes read through the wrapper (apply_fsdp reads
    ``layer.mlp`` of a wrapped layer). Gradients equal the unwrapped module's."""
    import contextlib

    import mindspore as ms
    import numpy as np
    from mindspore import nn

    from gradpool.errors import InvalidArgumentError
    from hyper_parallel.core.activation_checkpoint import checkpoint_wrapper

    entered = []

    def context_fn():
        @contextlib.contextmanager
        def phase(name):
            entered.append(name)
            yield
        return phase("forward"), phase("recompute")

    class Block(nn.Cell):
        def __init__(self):
            super().__init__()
            self.mlp = nn.Dense(4, 4, weight_init="normal", bias_init="zeros")

        def construct(self, x):
            return ms.ops.tanh(self.mlp(x)).sum()

    block = Block()
    wrapped = checkpoint_wrapper(block, context_fn=context_fn, early_stop=False)
    assert wrapped.mlp is block.mlp
    x = ms.Tensor(np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32))
    want = ms.grad(block, None, block.trainable_params())(x)
    got = ms.grad(wrapped, None, wrapped.trainable_params())(x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w.asnumpy(), rtol=1e-6)
    assert entered == ["forward", "recompute"]
    with pytest.raises(InvalidArgumentError, match="context_fn"):
        checkpoint_wrapper(block, context_fn="not callable")
