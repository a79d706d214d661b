"""The device pack (``host=False``: what Ascend runs) writes each byte of a bucket once and makes
no tensor of the bucket's size: counted on CPU by wrapping the ops the device path may call.

Every write into the bucket goes through ``Tensor.__setitem__`` or ``copy_``; their target
regions are summed. Every op that can return new memory is wrapped, and a result whose storage is
none of its inputs' counts as an allocation of that storage's size. The values are checked
against NumPy, over a bucket filled with NaN first (a byte not written shows).

And two writes the device path must get right, read back against NumPy: into a prefix of a
larger recycled bucket (not its whole storage), and of a transposed gradient sharded on dim 1."""
from __future__ import annotations

import contextlib
import math

import mindspore as ms
import ml_dtypes
import numpy as np
import pytest
from mindspore import mint

from gradpool import BucketPool, ReduceScatterLayout, pack_bucket
from gradpool import pack as pack_module
from gradpool import writers
from gradpool.dtypes import itemsize
from npref import normal, np_pack, raw_bytes, round_to, values

ms.set_device("CPU")
_ALLOCATING = [(mint, "cat"), (mint, "zeros"), (mint, "empty"), (mint, "add"),
               (ms.Tensor, "astype"), (ms.Tensor, "contiguous"), (ms.Tensor, "reshape"),
               (ms.Tensor, "__getitem__"), (ms.Tensor, "copy"), (ms.Tensor, "permute")]


def _storage(tensor):
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, ms.Tensor) else None


@contextlib.contextmanager
def counting():
    """Yields ``{"written": bytes, "allocations": [bytes, ...]}`` of the ops run inside."""
    seen = {"written": 0, "allocations": []}
    originals = []

    def wrap(owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            out = original(*args, **kwargs)
            inputs = {_storage(a) for a in list(args) + list(kwargs.values())
                      if isinstance(a, ms.Tensor)}
            for a in args:
                if isinstance(a, (list, tuple)):
                    inputs |= {_storage(x) for x in a if isinstance(x, ms.Tensor)}
            if isinstance(out, ms.Tensor) and out.numel() and _storage(out) not in inputs:
                seen["allocations"].append(out.untyped_storage().nbytes())
            return out
        originals.append((owner, name, original))
        setattr(owner, name, counted)

    for owner, name in _ALLOCATING:
        wrap(owner, name)
    setitem, copy_ = ms.Tensor.__setitem__, ms.Tensor.copy_

    def counted_setitem(self, index, value):
        region = getitem_raw(self, index)
        seen["written"] += region.numel() * region.itemsize
        return setitem(self, index, value)

    def counted_copy(self, source, *args, **kwargs):
        seen["written"] += self.numel() * self.itemsize
        return copy_(self, source, *args, **kwargs)

    getitem_raw = originals[[n for _, n, _ in originals].index("__getitem__")][2]
    ms.Tensor.__setitem__, ms.Tensor.copy_ = counted_setitem, counted_copy
    pack_module._zeros.cache_clear()      # its cached fillers would hide an allocation
    try:
        yield seen
    finally:
        ms.Tensor.__setitem__, ms.Tensor.copy_ = setitem, copy_
        for owner, name, original in originals:
            setattr(owner, name, original)


def _reference(arrays, layout: ReduceScatterLayout) -> np.ndarray:
    """The bucket as NumPy lays it out: row r holds chunk r of every gradient at its offset."""
    out = np.zeros((layout.world_size, layout.row_numel))
    for slot, array in zip(layout.slots, arrays):
        padded = np.zeros(slot.padded_shape)
        padded[tuple(slice(0, n) for n in array.shape)] = array
        chunks = np.split(padded, layout.world_size, axis=slot.shard_dim)
        for rank, chunk in enumerate(chunks):
            out[rank, slot.offset:slot.offset + slot.chunk_numel] = chunk.reshape(-1)
    return out.reshape(-1)


CASES = {   # shapes, shard dims, world, alignment, gradient dtype, bucket dtype
    "dim0 uneven, gaps": ([(13, 7), (5,), (64, 3)], [0, 0, 0], 4, 8, ms.float32, ms.float32),
    "dim0 exact": ([(8, 16), (4, 4)], [0, 0], 2, 1, ms.float32, ms.float32),
    "empty shards": ([(3, 5), (2,)], [0, 0], 4, 4, ms.float32, ms.float32),
    "f32 -> f16": ([(13, 7), (9,)], [0, 0], 4, 8, ms.float32, ms.float16),
    "f32 -> bf16": ([(13, 7), (9,)], [0, 0], 4, 8, ms.float32, ms.bfloat16),
    "bf16 -> bf16": ([(13, 7), (9,)], [0, 0], 2, 8, ms.bfloat16, ms.bfloat16),
    "bf16 -> f32": ([(13, 7), (9,)], [0, 0], 2, 8, ms.bfloat16, ms.float32),
    "Shard(1)": ([(6, 10), (7,)], [1, 0], 4, 4, ms.float32, ms.float32),
}


def _values(shape, rng) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _as_float(tensor: ms.Tensor) -> np.ndarray:
    return tensor.astype(ms.float32).asnumpy().astype(np.float64)


@pytest.mark.parametrize("name", list(CASES))
def test_the_device_pack_writes_each_byte_once_without_a_bucket_sized_tensor(name):
    shapes, dims, world, align, src, dst = CASES[name]
    rng = np.random.default_rng(0)
    arrays = [_values(s, rng) for s in shapes]
    if src == ms.bfloat16:          # values the bucket holds exactly
        arrays = [a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in arrays]
    grads = [ms.Tensor(a).astype(src) for a in arrays]
    layout = ReduceScatterLayout.build(shapes, world, align, dims)
    pool = BucketPool(poison_on_release=True)
    lease = pool.acquire(layout.total_numel, dst)
    if dst == ms.bfloat16:
        lease.tensor.view(ms.int16)[:] = 0x7FC0        # NaN bits (CPU: no bfloat16 setitem)
    else:
        lease.tensor[:] = float("nan")
    bucket_bytes = layout.total_numel * lease.tensor.itemsize
    with counting() as seen:
        pack_bucket(lease, grads, layout, host=False)
    expected = _reference([a.astype(np.float64) for a in arrays], layout)
    if dst != ms.float32:
        expected = ms.Tensor(expected.astype(np.float32)).astype(dst).astype(ms.float32).asnumpy()
    np.testing.assert_array_equal(_as_float(lease.tensor), expected)
    assert seen["written"] == bucket_bytes, (seen["written"], bucket_bytes)
    largest = max(seen["allocations"], default=0)
    assert largest < bucket_bytes, seen["allocations"]
    # On CPU a cast to or from bfloat16 goes through a tensor of the gradient's size; a
    # Shard(1) gradient is padded and permuted into chunk order first (two of its padded size,
    # and the zero filler, cached between packs); nothing else may allocate.
    needs_temp = (dst == ms.bfloat16) != (src == ms.bfloat16) or 1 in dims
    if needs_temp:
        wider = max(ms.Tensor(np.zeros(1), dtype=d).itemsize for d in (src, dst))
        budget = sum(wider * (slot.chunk_numel * world * 2 + slot.shard_padding_numel
                              if slot.shard_dim else slot.chunk_numel * world)
                     for slot in layout.slots)
        assert sum(seen["allocations"]) <= budget, (seen["allocations"], budget)
    else:
        assert seen["allocations"] == [], seen["allocations"]
    lease.release()


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if ms.bfloat16 not in c[4:]])
def test_the_strided_block_form_ascend_runs_writes_the_same_values(name, monkeypatch):
    """The form that writes each block with one strided slice-assignment (Ascend's): the same
    bucket on CPU. Its bytes are not counted here: on CPU a slice-assignment into a view is
    rewritten through the view's base."""
    shapes, dims, world, align, src, dst = CASES[name]
    monkeypatch.setattr(pack_module, "_writes_by_rows", lambda: False)
    rng = np.random.default_rng(1)
    arrays = [_values(s, rng) for s in shapes]
    layout = ReduceScatterLayout.build(shapes, world, align, dims)
    lease = BucketPool().acquire(layout.total_numel, dst)
    lease.tensor[:] = float("nan")
    pack_bucket(lease, [ms.Tensor(a).astype(src) for a in arrays], layout, host=False)
    expected = _reference([a.astype(np.float64) for a in arrays], layout)
    if dst != ms.float32:
        expected = ms.Tensor(expected.astype(np.float32)).astype(dst).astype(ms.float32).asnumpy()
    np.testing.assert_array_equal(_as_float(lease.tensor), expected)
    lease.release()


# -- a prefix of a larger bucket, a non-contiguous dim-1 gradient ---------------------------------
def test_device_pack_into_a_prefix_of_a_larger_recycled_bucket():
    """A lease on a larger recycled bucket is a prefix view (not its whole storage): the device
    path must write it with slice-assignment (copy_ into a prefix raises on CPU), exactly, and
    leave the rest of the bucket alone."""
    for dtype in (ms.float32, ms.float16, ms.bfloat16):
        pool = BucketPool(device="CPU", alignment_bytes=4)
        pool.acquire(1000, dtype).release()
        layout = ReduceScatterLayout.build([(7, 3), (5,)], 2, pool.alignment_elements(dtype))
        lease = pool.acquire(layout.total_numel, dtype)
        assert not lease.is_whole_bucket
        used = layout.total_numel * itemsize(dtype)
        tail_before = raw_bytes(lease.allocation)[used:]
        rng = np.random.default_rng(5)
        raw = [normal(rng, (7, 3)), normal(rng, (5,))]
        writers.pack(lease, [ms.Tensor(v) for v in raw], layout, host=False)
        np.testing.assert_array_equal(values(lease.tensor), round_to(np_pack(raw, layout), dtype))
        assert raw_bytes(lease.allocation)[used:] == tail_before
        lease.release()


@pytest.mark.parametrize("shape", [(3, 4), (3, 5)], ids=["even", "uneven"])
def test_device_pack_of_a_non_contiguous_dim1_gradient(shape):
    """A transposed (non-contiguous) gradient sharded on dim 1, on the device path (the one
    Ascend takes, which chunks it with a view)."""
    raw = normal(np.random.default_rng(4), shape[::-1])
    grad = ms.Tensor(raw).T
    assert not grad.is_contiguous()
    layout = ReduceScatterLayout.build([shape], 2, 1, [1])
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel, ms.float32)
    writers.pack(lease, [grad], layout, host=False)
    np.testing.assert_array_equal(values(lease.tensor), np_pack([raw.T], layout))
    lease.release()
