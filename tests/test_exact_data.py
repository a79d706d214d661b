"""Packs, shard views and chunk geometry are bit-exact with NumPy on random standard-normal data.

``tests/test_pack.py`` also reads packs back, on data exact in every dtype (multiples of 1/8);
here the data are random float32 that float16 and bfloat16 cannot hold, so a pack that truncates
(float32 kept to bfloat16 precision, say), rounds twice or drops a value fails. A same-dtype pack
must reproduce the gradient's bytes; a cast must be NumPy's / ml_dtypes' round-to-nearest-even
(measured equal to MindSpore 2.10's CPU cast). Both write paths (``host``), world sizes 1-4
(uneven shards), dim-0 and dim-1 shards, with and without alignment gaps.
"""
from __future__ import annotations

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest

from gradpool import pack as packing
from gradpool import writers
from gradpool.comm import SingleProcessCommunicator
from gradpool.dtypes import itemsize
from gradpool.layout import GradSlot, ReduceScatterLayout
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig
from npref import name_of, normal, np_chunk, np_pack, raw_bytes, round_to, values

ms.set_device("CPU")

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
NP_TYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
LAYOUTS = {
    "dim0": ([(7, 3), (16,), (1, 4), (9, 2, 3)], [0, 0, 0, 0]),
    "dim1": ([(3, 5), (7, 3), (2, 7, 2)], [1, 0, 1]),
    "one": ([(5,)], [0]),
}


def bytes_of(values_f32: np.ndarray, dtype) -> bytes:
    """``values`` (float32 values of ``dtype``) as ``dtype``'s bytes."""
    return np.asarray(values_f32, np.float32).astype(NP_TYPE[name_of(dtype)]).tobytes()


def grads(rng, shapes, dtype):
    raw = [normal(rng, s) for s in shapes]
    return [round_to(v, dtype) for v in raw], [ms.Tensor(v).astype(dtype) for v in raw]


def test_data_are_not_exact_in_16_bit_dtypes():
    """The premise: these data change when rounded to bfloat16 or float16."""
    vals = normal(np.random.default_rng(0), (1000,))
    assert np.mean(round_to(vals, "bfloat16") != vals) > 0.9
    assert np.mean(round_to(vals, "float16") != vals) > 0.9


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("align_bytes", [4, 64])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("grad_name", sorted(DTYPES))
@pytest.mark.parametrize("bucket_name", sorted(DTYPES))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pack_is_bit_exact(world, bucket_name, grad_name, layout_name, align_bytes, host):
    bucket, grad = DTYPES[bucket_name], DTYPES[grad_name]
    shapes, dims = LAYOUTS[layout_name]
    pool = BucketPool(device="CPU", alignment_bytes=align_bytes, poison_on_release=True)
    layout = ReduceScatterLayout.build(shapes, world, pool.alignment_elements(bucket), dims)
    vals, tensors = grads(np.random.default_rng(world), shapes, grad)
    before = [raw_bytes(t) for t in tensors]
    pool.acquire(layout.total_numel, bucket).release()        # recycled, poisoned with NaN
    lease = pool.acquire(layout.total_numel, bucket)
    written = writers.pack(lease, tensors, layout, host=host)
    expected = round_to(np_pack(vals, layout), bucket)
    np.testing.assert_array_equal(values(lease.tensor), expected)
    assert raw_bytes(lease.tensor) == bytes_of(expected, bucket)
    if bucket == grad and layout.is_identity():
        assert raw_bytes(lease.tensor) == before[0]            # the gradient's own bytes
    assert written == packing.Written(layout.total_numel * itemsize(bucket),
                                      layout.padding_numel * itemsize(bucket), host)
    assert [raw_bytes(t) for t in tensors] == before
    lease.release()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
def test_shard_views_of_every_row_are_exact(world, layout_name):
    """Each rank's output row, cut by shard_views, is that rank's chunk of every gradient (the
    padding of an uneven shard zero), with the chunk's shape."""
    shapes, dims = LAYOUTS[layout_name]
    pool = BucketPool(device="CPU", alignment_bytes=64)
    layout = ReduceScatterLayout.build(shapes, world, pool.alignment_elements(ms.float32), dims)
    vals, tensors = grads(np.random.default_rng(7 + world), shapes, ms.float32)
    lease = pool.acquire(layout.total_numel, ms.float32)
    writers.pack(lease, tensors, layout, host=True)
    packed = values(lease.tensor).astype(np.float32)
    for rank in range(world):
        row = ms.Tensor(packed[rank * layout.row_numel:(rank + 1) * layout.row_numel].copy())
        views = packing.shard_views(row, layout)
        assert len(views) == len(shapes)
        for view, value, slot in zip(views, vals, layout.slots):
            assert tuple(view.shape) == slot.chunk_shape
            np.testing.assert_array_equal(values(view), np_chunk(value, slot.shard_dim, rank,
                                                                 world))
    lease.release()


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
@pytest.mark.parametrize("shape, dim", [((7, 3), 0), ((3, 7), 1), ((2, 5, 3), 1), ((9,), 0),
                                        ((4, 6), 1), ((1, 4), 0)])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_local_shard_and_unshard_are_exact(world, shape, dim, dtype_name):
    dtype = DTYPES[dtype_name]
    vals, (tensor,) = grads(np.random.default_rng(3), [shape], dtype)
    slot = GradSlot.of(shape, world, dim)
    chunks = []
    for rank in range(world):
        local = packing.local_shard(tensor, slot, rank)
        assert tuple(local.shape) == slot.chunk_shape and local.dtype == dtype
        np.testing.assert_array_equal(values(local), np_chunk(vals[0], dim, rank, world))
        chunks.append(local.reshape(-1))
    from mindspore import mint
    full = packing.unshard(mint.cat(chunks), slot)
    assert tuple(full.shape) == shape
    assert raw_bytes(full.contiguous()) == raw_bytes(tensor)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("fusion", [True, False], ids=["fused", "pergrad"])
@pytest.mark.parametrize("dtype_name", ["float32", "float16", "bfloat16"])
def test_same_dtype_reduce_at_world_1_returns_the_gradients_bytes(dtype_name, fusion, host):
    """A same-dtype reduce of one rank is the identity: every shard holds its gradient's bytes."""
    dtype = DTYPES[dtype_name]
    shapes, dims = LAYOUTS["dim1"]
    _, tensors = grads(np.random.default_rng(11), shapes, dtype)
    reducer = GradReducer(BucketPool(poison_on_release=True), SingleProcessCommunicator(),
                          ReducerConfig(reduce_dtype=dtype, comm_fusion=fusion, host_copies=host))
    for op in ("avg", "sum"):
        result = reducer.reduce_scatter(tensors, dims, op=op)
        shards = result.wait()
        assert [raw_bytes(s.contiguous()) for s in shards] == [raw_bytes(t) for t in tensors]
        result.release()
