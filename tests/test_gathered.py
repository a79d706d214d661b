"""GatheredParam: the memory of one full parameter that fully_shard releases after forward and
regrows before backward. Values against NumPy, storage sizes read back from MindSpore, and the
autograd contract (a refill must not bump the tensor's version) through a real backward."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, mint
from mindspore.common._grad_function import _Function

from gradpool import GatheredParam, InvalidArgumentError, LeaseStateError

ms.set_device("CPU")
DTYPES = [ms.float32, ms.float16, ms.bfloat16]


def values(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def as_f32(tensor) -> np.ndarray:
    return tensor.astype(ms.float32).asnumpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_release_frees_the_storage_and_fill_regrows_it_in_the_same_tensor(dtype):
    buffer = GatheredParam((6, 5), dtype)
    first = ms.Tensor(values((6, 5), 1)).astype(dtype)
    tensor = buffer.fill(first)
    np.testing.assert_array_equal(as_f32(tensor), as_f32(first))
    assert tensor.untyped_storage().size() == buffer.nbytes == 30 * first.itemsize
    buffer.release()
    assert (tensor.untyped_storage().size(), buffer.resident, buffer.valid) == (0, False, False)
    second = ms.Tensor(values((6, 5), 2)).astype(dtype)
    assert buffer.fill(second) is tensor                   # the same object autograd may hold
    np.testing.assert_array_equal(as_f32(tensor), as_f32(second))
    assert tensor.untyped_storage().size() == buffer.nbytes
    assert (buffer.stats.fills, buffer.stats.releases, buffer.stats.regrows) == (2, 1, 1)


def test_fill_casts_and_reads_a_view_of_a_larger_storage():
    """A gathered full tensor may be a prefix view of a padded buffer (uneven shards)."""
    padded = ms.Tensor(values((9, 4)))
    buffer = GatheredParam((7, 4), ms.bfloat16)
    buffer.fill(padded.narrow(0, 0, 7))
    want = ms.Tensor(values((9, 4))[:7]).astype(ms.bfloat16)
    np.testing.assert_array_equal(as_f32(buffer.tensor), as_f32(want))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_poison_keeps_the_memory_and_fills_it_with_nan(dtype):
    buffer = GatheredParam((4, 3), dtype, poison=True)
    buffer.fill(ms.Tensor(values((4, 3))).astype(dtype))
    buffer.release()
    assert buffer.resident and not buffer.valid
    assert np.isnan(as_f32(buffer.tensor)).all()
    with pytest.raises(LeaseStateError, match="released after forward"):
        buffer.check_valid()


def test_poison_writes_nan_when_released_inside_a_recorded_forward():
    """fully_shard releases in a forward hook, while autograd records: the NaN must land in the
    tensor autograd saved (a slice assignment there writes a new tensor and leaves it intact)."""
    buffer = GatheredParam((4, 3), ms.float32, poison=True)
    seen = {}

    def loss(x):
        out = mint.matmul(x, buffer.fill(ms.Tensor(values((4, 3)))))
        buffer.release()
        seen["released"] = buffer.tensor.asnumpy()
        return out.sum()

    ms.value_and_grad(loss)(ms.Tensor(values((2, 4))))
    assert np.isnan(seen["released"]).all()


def test_bad_shapes_are_refused_by_name():
    with pytest.raises(InvalidArgumentError, match=r"\(2, -1\)"):
        GatheredParam((2, -1), ms.float32)
    buffer = GatheredParam((2, 3), ms.float32)
    with pytest.raises(InvalidArgumentError, match=r"shape \(2, 3\) with shape \(3, 2\)"):
        buffer.fill(ms.Tensor(values((3, 2))))


def test_a_backward_reads_the_refilled_memory_and_the_version_is_not_bumped():
    """Freed after forward, refilled before backward (from a function on the output, as the
    unit's backward pre-hook does): autograd accepts the tensor (no "modified by an inplace
    operation") and the gradients are the ones of a run that never freed, bit for bit; refilled
    with other values, the input gradient follows them (backward really read the memory)."""
    w, x = values((8, 8), 3), values((4, 8), 4)
    shard = Parameter(ms.Tensor(w), name="w")
    state = {}

    class Gather(_Function):
        @staticmethod
        def forward(ctx, s):
            return state["buffer"].fill(s)

        @staticmethod
        def backward(ctx, g):
            return g

    class Refill(_Function):
        @staticmethod
        def forward(ctx, y):
            return mint.mul(y, 1.0)

        @staticmethod
        def backward(ctx, g):
            if state["free"]:
                state["buffer"].fill(ms.Tensor(w * state["scale"]))
            return g

    def loss(xs, s):
        y = Refill.apply(mint.tanh(mint.matmul(xs, Gather.apply(s))))
        if state["free"]:
            state["buffer"].release()
            assert state["buffer"].tensor.untyped_storage().size() == 0
        return (y ** 2).sum()

    def grads(free, scale=1.0):
        state.update(buffer=GatheredParam((8, 8), ms.float32), free=free, scale=scale)
        _, (gx, (gw,)) = ms.value_and_grad(loss, (0,), [shard])(ms.Tensor(x), shard)
        return gx.asnumpy().copy(), gw.asnumpy().copy()

    kept, freed = grads(False), grads(True)
    for a, b in zip(kept, freed):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(grads(True, scale=0.5)[0], kept[0])
