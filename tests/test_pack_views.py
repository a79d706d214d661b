"""gradpool.pack's views, on no particular copy path (test_pack.py runs every test on both):
flat_view, how a zero-copy borrow reads the caller's gradient (1-D, its values, its memory; on CPU
through host memory, never the device view op), and shard_views' refusal of a wrong output."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import mint

from gradpool import pack as packing
from gradpool.errors import LayoutMismatchError
from gradpool.layout import ReduceScatterLayout
from gradpool.pack import flat_view

ms.set_device("CPU")


def test_flat_view_keeps_values_and_aliases_what_it_can():
    """flat_view is how a zero-copy borrow reads the caller's gradient: 1-D, the same values in
    logical order, and (for a contiguous tensor) the same memory."""
    whole = ms.Tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    flat = flat_view(whole)
    assert tuple(flat.shape) == (12,)
    whole.asnumpy()[0, 1] = 100.0                          # CPU: asnumpy() is the memory
    assert flat.asnumpy()[1] == 100.0
    base = ms.Tensor(np.zeros(24, np.float32))
    for start in (0, 12):                                  # 2-D views of part of a storage
        part = flat_view(base[start:start + 12].view(3, 4))
        assert tuple(part.shape) == (12,)
        base.asnumpy()[start + 5] = start + 1.0
        assert part.asnumpy()[5] == start + 1.0, "not the caller's memory"
    transposed = ms.Tensor(np.arange(12, dtype=np.float32).reshape(4, 3)).T
    assert not transposed.is_contiguous()
    np.testing.assert_array_equal(flat_view(transposed).asnumpy(),
                                  np.arange(12, dtype=np.float32).reshape(4, 3).T.reshape(-1))


def test_cpu_flat_view_of_a_whole_storage_tensor_queues_no_view_op(monkeypatch):
    """On CPU a 2-D tensor that spans its storage is flattened through its host memory, never
    through the view op (its launch-thread wait was a zero-copy borrow's whole cost, issue 12):
    the same memory and values, with the device path's flat view unreachable."""

    def no_view_op(tensor):
        raise AssertionError("the CPU path took the device view op")

    monkeypatch.setattr(packing, "_device_flat", no_view_op)
    raw = np.random.default_rng(2).standard_normal((3, 4)).astype(np.float32)
    whole = ms.Tensor(raw.copy())
    flat = packing.flat_view(whole)
    np.testing.assert_array_equal(flat.asnumpy(), raw.reshape(-1))
    whole.asnumpy()[2, 3] = 7.0                             # CPU: asnumpy() is the memory
    assert flat.asnumpy()[11] == 7.0


def test_shard_views_refuse_a_wrong_output_naming_the_shapes():
    layout = ReduceScatterLayout.build([(5, 3), (4,)], 2, 4)
    with pytest.raises(LayoutMismatchError) as err:
        packing.shard_views(mint.zeros(5), layout)
    assert str(err.value) == "output has shape (5,); the layout's row needs (16,)"
