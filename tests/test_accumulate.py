"""gradpool.pack.accumulate (gradient-accumulation micro-steps), in-process, against NumPy.

Micro-steps of float32, float16 and bfloat16 gradients into buckets of every dtype, with the
layouts of world sizes 1, 2 and 3 (at 2 and 3 uneven shards: the last chunk of a gradient is a
partial row, and at 3 whole rows are padding), on both write paths: ``host=True`` (NumPy in the
bucket's host memory: on a CPU pool for every dtype pair and shard dim) and ``host=False`` (the
device path, the one Ascend takes). Data are random standard-normal float32, so every rounding
shows; the whole bucket (data, uneven-shard padding, alignment gaps) is compared bit for bit with
the NumPy reference: pack rounds each value once into the bucket dtype, each accumulate adds in
float32 and rounds once (:mod:`npref`).
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from gradpool import writers
from gradpool.dtypes import itemsize
from gradpool.errors import LayoutMismatchError, LeaseStateError
from gradpool.layout import ReduceScatterLayout
from gradpool.pool import BucketPool
from npref import add_rounded, name_of, normal, np_pack, raw_bytes, round_to, values

ms.set_device("CPU")

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
NP_DTYPE = {"float32": np.float32, "float16": np.float16}
# (7, 3): 21 elements; at W=2 one full row of 12 and a partial row of 9, at W=3 two rows of 9 and
# a partial row of 3. (1, 4) at W=3: ranks 1 and 2 hold only padding. (10,), (5,): 1-D partial
# rows. (3, 5) is sharded on dim 1 in the "dim1" layouts (the device path only).
SHAPES = [(7, 3), (5,), (1, 4), (10,), (3, 5), (8, 4)]
DIMS = {"dim0": [0, 0, 0, 0, 0, 0], "dim1": [0, 0, 0, 0, 1, 0]}
MICRO_STEPS = 3
ALIGN_BYTES = 16          # 4 float32 / 8 16-bit elements: alignment gaps inside every row


def grads_of(step: int, dtype, shapes=SHAPES) -> tuple[list[np.ndarray], list[ms.Tensor]]:
    """Micro-step ``step``: the values each gradient tensor holds (float32) and the tensors."""
    rng = np.random.default_rng(100 + step)
    raw = [normal(rng, s) for s in shapes]
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(shapes)
    tensors = [ms.Tensor(v).astype(d) for v, d in zip(raw, dtypes)]
    return [round_to(v, d) for v, d in zip(raw, dtypes)], tensors


def poisoned_lease(pool: BucketPool, numel: int, dtype):
    """A lease on a recycled bucket full of NaN: every element the pack leaves unwritten shows."""
    pool.acquire(numel, dtype).release()
    lease = pool.acquire(numel, dtype)
    assert np.isnan(values(lease.tensor)).all()
    return lease


def assert_bucket_is(lease, expected_f32: np.ndarray, dtype) -> None:
    """The bucket's bytes are exactly ``expected`` (float32 values of ``dtype``) cast to dtype."""
    got = values(lease.tensor)
    np.testing.assert_array_equal(got, expected_f32.astype(np.float64))
    name = name_of(dtype)
    if name in NP_DTYPE:
        assert raw_bytes(lease.tensor) == expected_f32.astype(NP_DTYPE[name]).tobytes()
    else:
        import ml_dtypes
        assert raw_bytes(lease.tensor) == expected_f32.astype(ml_dtypes.bfloat16).tobytes()


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("dims", sorted(DIMS))
@pytest.mark.parametrize("grad_name", sorted(DTYPES))
@pytest.mark.parametrize("bucket_name", sorted(DTYPES))
@pytest.mark.parametrize("world", [1, 2, 3])
def test_micro_steps_accumulate_exactly(world, bucket_name, grad_name, dims, host):
    bucket, grad = DTYPES[bucket_name], DTYPES[grad_name]
    pool = BucketPool(device="CPU", alignment_bytes=ALIGN_BYTES, poison_on_release=True)
    layout = ReduceScatterLayout.build(SHAPES, world, pool.alignment_elements(bucket), DIMS[dims])
    if world > 1:
        assert any(s.numel % s.chunk_numel for s in layout.slots), "no partial row: not a test"
    if world == 3:
        assert any(s.valid_length(2) == 0 for s in layout.slots), "no all-padding chunk"
    assert layout.gaps(), "no alignment gap: not a test"
    lease = poisoned_lease(pool, layout.total_numel, bucket)
    expected = None
    on_host = host                 # a CPU pool: the host path whenever it is asked for
    size = itemsize(bucket)
    for step in range(MICRO_STEPS):
        vals, tensors = grads_of(step, grad)
        before = [raw_bytes(t) for t in tensors]
        if step == 0:
            written = writers.pack(lease, tensors, layout, host=host)
            expected = round_to(np_pack(vals, layout), bucket)
            assert written.padding_bytes == layout.padding_numel * size
        else:
            written = writers.accumulate(lease, tensors, layout, host=host)
            expected = add_rounded(expected, np_pack(vals, layout), bucket)
            assert written.padding_bytes == 0          # an accumulate adds, it pads nothing
        assert written.nbytes == layout.total_numel * size
        assert written.on_host == on_host
        assert [raw_bytes(t) for t in tensors] == before, "a gradient was written"
        assert_bucket_is(lease, expected, bucket)
    lease.release()


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_mixed_gradient_dtypes_in_one_bucket(world, host):
    """One fused bucket of float32, float16 and bfloat16 gradients: each value is rounded once
    into the bucket (mixed inputs are widened to float32 first, exactly)."""
    mixed = [ms.float32, ms.float16, ms.bfloat16, ms.float32, ms.float16, ms.bfloat16]
    for bucket in (ms.float32, ms.float16, ms.bfloat16):
        pool = BucketPool(device="CPU", alignment_bytes=ALIGN_BYTES, poison_on_release=True)
        layout = ReduceScatterLayout.build(SHAPES, world, pool.alignment_elements(bucket))
        lease = poisoned_lease(pool, layout.total_numel, bucket)
        expected = None
        for step in range(MICRO_STEPS):
            vals, tensors = grads_of(step, mixed)
            if step == 0:
                written = writers.pack(lease, tensors, layout, host=host)
                expected = round_to(np_pack(vals, layout), bucket)
            else:
                written = writers.accumulate(lease, tensors, layout, host=host)
                expected = add_rounded(expected, np_pack(vals, layout), bucket)
            assert written.on_host is host
            assert_bucket_is(lease, expected, bucket)
        lease.release()


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
@pytest.mark.parametrize("bucket_name", ["float32", "float16"])
def test_float16_micro_steps_into_float32_bucket_take_the_host_path(bucket_name, host):
    """float16 micro-steps into a float32 bucket (and float32 into float16) are NumPy dtypes:
    the host path applies when asked and must widen before adding."""
    bucket = DTYPES[bucket_name]
    grad = ms.float16 if bucket == ms.float32 else ms.float32
    pool = BucketPool(device="CPU", alignment_bytes=ALIGN_BYTES)
    layout = ReduceScatterLayout.build(SHAPES, 3, pool.alignment_elements(bucket))
    lease = pool.acquire(layout.total_numel, bucket)
    vals0, t0 = grads_of(0, grad)
    vals1, t1 = grads_of(1, grad)
    assert writers.pack(lease, t0, layout, host=host).on_host is host
    assert writers.accumulate(lease, t1, layout, host=host).on_host is host
    assert_bucket_is(lease, add_rounded(round_to(np_pack(vals0, layout), bucket),
                                        np_pack(vals1, layout), bucket), bucket)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
def test_identity_layout_accumulates(host):
    """One evenly divisible dim-0 gradient and no alignment gap (the identity layout: the device
    path writes straight from the gradient)."""
    pool = BucketPool(device="CPU", alignment_bytes=4, poison_on_release=True)
    shapes = [(6, 4)]
    layout = ReduceScatterLayout.build(shapes, 2, pool.alignment_elements(ms.float32))
    assert layout.is_identity()
    lease = poisoned_lease(pool, layout.total_numel, ms.float32)
    vals0, t0 = grads_of(0, ms.float32, shapes)
    vals1, t1 = grads_of(1, ms.float32, shapes)
    writers.pack(lease, t0, layout, host=host)
    assert_bucket_is(lease, np_pack(vals0, layout).astype(np.float32), ms.float32)
    writers.accumulate(lease, t1, layout, host=host)
    assert_bucket_is(lease, add_rounded(np_pack(vals0, layout), np_pack(vals1, layout),
                                        ms.float32), ms.float32)


@pytest.mark.parametrize("host", [True, False], ids=["host", "device"])
def test_accumulate_checks_before_writing(host):
    pool = BucketPool(device="CPU", alignment_bytes=ALIGN_BYTES)
    layout = ReduceScatterLayout.build(SHAPES, 2, pool.alignment_elements(ms.float32))
    lease = pool.acquire(layout.total_numel, ms.float32)
    vals, tensors = grads_of(0, ms.float32)
    writers.pack(lease, tensors, layout, host=host)
    before = raw_bytes(lease.tensor)
    with pytest.raises(LayoutMismatchError, match="got 5 gradients for a layout of 6"):
        writers.accumulate(lease, tensors[:5], layout, host=host)
    wrong = tensors[:1] + [ms.Tensor(np.ones((4,), np.float32))] + tensors[2:]
    with pytest.raises(LayoutMismatchError, match=r"gradient 1 has shape \(4,\)"):
        writers.accumulate(lease, wrong, layout, host=host)
    other = ReduceScatterLayout.build(SHAPES, 3, pool.alignment_elements(ms.float32))
    if other.total_numel != layout.total_numel:
        with pytest.raises(LayoutMismatchError, match="lease holds"):
            writers.accumulate(lease, tensors, other, host=host)
    assert raw_bytes(lease.tensor) == before
    lease.release()
    with pytest.raises(LeaseStateError):
        writers.accumulate(lease, tensors, layout, host=host)
