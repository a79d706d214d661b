"""Checkpoint save and load of a 64 MiB dense stack (4 layers of 2048 x 2048 float32) in one
process, unsharded; asserts the loaded values bit for bit. The per-rank figures under msrun
(the tiny model and a 1 GiB stack) come from ``python -m benchmarks.checkpoint``."""
import mindspore as ms
import numpy as np
import pytest

from benchmarks.memory_worker import build_stack
from hyper_parallel import checkpoint

ms.set_device("CPU")
LAYERS, HIDDEN = 4, 2048


@pytest.fixture(scope="module")
def stack():
    return build_stack(LAYERS, HIDDEN, seed=0)


def test_save(benchmark, stack, tmp_path):
    benchmark.group = f"checkpoint {LAYERS} x {HIDDEN}^2 float32, one process"
    result = benchmark(checkpoint.save, tmp_path / "ck", stack)
    benchmark.extra_info.update(bytes=result.bytes_written)
    assert result.bytes_written > LAYERS * HIDDEN * HIDDEN * 4


def test_load(benchmark, stack, tmp_path):
    checkpoint.save(tmp_path / "ck", stack)
    other = build_stack(LAYERS, HIDDEN, seed=1)
    benchmark.group = f"checkpoint {LAYERS} x {HIDDEN}^2 float32, one process"
    loaded = benchmark(checkpoint.load, tmp_path / "ck", other)
    benchmark.extra_info.update(bytes=loaded["bytes_read"])
    for a, b in zip(stack.trainable_params(), other.trainable_params()):
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
