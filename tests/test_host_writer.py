"""gradpool.host (the CPU host path behind gradpool.writers): host views of bucket and tensor
memory and the weak cache of them, the compiled float32 -> bfloat16 cast (with a stand-in kernel)
and its absence without numba, the compiled address writers and the single-gradient pack they
serve, and host writes that give the device path's bits (NaNs, overflow, no NumPy warnings)."""
import ctypes
import gc
import sys
import warnings
import weakref

import ml_dtypes
import mindspore as ms
import numpy as np
import pytest

from gradpool import pack as packing
from gradpool import writers
# The tests parametrized by a ``writers`` argument (which path writes) reach the module as this.
from gradpool import writers as writing
from gradpool.dtypes import data_pointer
from gradpool.errors import LayoutMismatchError, LeaseStateError
from gradpool.host import kernels, views
from gradpool.host.kernels import STREAM_FROM_BYTES
from gradpool.host.views import host_view
from gradpool.host.writer import host_writer
from gradpool.layout import ReduceScatterLayout
from gradpool.pool import BucketPool
from npref import add_rounded, normal, np_pack, raw_bytes, round_to, values

ms.set_device("CPU")


# -- views: NaNs, host views of tensors -----------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_host_view_is_the_memory_of_a_whole_tensor_and_a_copy_of_a_part(dtype):
    """host_view's two cases: a tensor spanning its storage is viewed in place (a write lands in
    the tensor); a view of part of a storage is read through a copy (a write does not)."""
    raw = round_to(np.random.default_rng(32).standard_normal(8), dtype)
    whole = ms.Tensor(raw).astype(getattr(ms, dtype))
    part = whole[2:6]
    copy = host_view(part)
    np.testing.assert_array_equal(copy.astype(np.float32), raw[2:6])
    copy[0] = 99.0
    np.testing.assert_array_equal(values(whole), raw)
    host_view(whole)[3] = 5.0
    expected = raw.copy()
    expected[3] = 5.0
    np.testing.assert_array_equal(values(whole), expected)


# -- host writes give the device path's bits ------------------------------------------------------
def _nan_payload_data():
    f16 = np.array([1.0, -2.0, 0.5, 3.0, 65504.0, -65504.0, 0.25, 7.0], np.float16)
    bits = f16.view(np.uint16)
    bits[2] = 0x7E01                 # NaN with a payload
    bits[6] = 0xFD55                 # negative NaN with a payload (signalling pattern)
    return f16


@pytest.mark.parametrize("shape", [(8,), (7,)], ids=["identity", "padded"])
def test_host_accumulate_of_nans_writes_mindspore_s_bits(shape):
    """A float16 micro-step holding NaNs with payloads, added into a float16 bucket, writes the
    same bits on the host path as on the device path (MindSpore's canonical NaN)."""
    data = _nan_payload_data()[:shape[0]]
    layout = ReduceScatterLayout.build([shape], 2, 1)
    out = {}
    for host in (True, False):
        lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel,
                                                                    ms.float16)
        writers.pack(lease, [ms.Tensor(np.ones(shape, np.float16))], layout, host=host)
        writers.accumulate(lease, [ms.Tensor(data.copy())], layout, host=host)
        out[host] = raw_bytes(lease.tensor)
        lease.release()
    assert out[True] == out[False]


@pytest.mark.parametrize("shape", [(8,), (7,)], ids=["identity", "padded"])
def test_host_writes_raise_no_numpy_warnings_on_overflow_and_nan(shape):
    """Overflowing casts and inf - inf are written as MindSpore writes them (inf, NaN) without
    NumPy's RuntimeWarnings (a warnings-as-errors caller must not fail), bit-equal with the
    device path."""
    big = np.array([7e4, -7e4, np.inf, 1.0, 2.0, -np.inf, 3.0, 1e6], np.float32)[:shape[0]]
    neg = np.array([1.0, 1.0, -np.inf, 1.0, 1.0, np.inf, 1.0, 1.0], np.float32)[:shape[0]]
    layout = ReduceScatterLayout.build([shape], 2, 1)
    out = {}
    for host in (True, False):
        lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel,
                                                                    ms.float16)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            writers.pack(lease, [ms.Tensor(big)], layout, host=host)          # overflow
            writers.accumulate(lease, [ms.Tensor(neg)], layout, host=host)    # inf + -inf
        out[host] = raw_bytes(lease.tensor)
        lease.release()
    assert out[True] == out[False]


# -- the writer's host views of buckets -----------------------------------------------------------
def test_host_views_neither_keep_buckets_alive_nor_outlive_their_allocation():
    """The host writer keeps one host view per allocation, weakly: a dropped pool's bucket must
    still be freed (the view does not hold the tensor) and its view goes with it; a trimmed
    bucket's view is never written through again (its storage's pointer is no longer the
    view's, so the writer would rebuild it, and a released storage has no view to build)."""
    views = host_writer()._views
    layout = ReduceScatterLayout.build([(5, 3), (4,)], 2, 1)
    raw = [normal(np.random.default_rng(33), s) for s in ((5, 3), (4,))]
    pool = BucketPool(device="CPU", alignment_bytes=4)
    lease = pool.acquire(layout.total_numel, ms.float32)
    writers.pack(lease, [ms.Tensor(r) for r in raw], layout, host=True)
    np.testing.assert_array_equal(values(lease.tensor), np_pack(raw, layout, "float32"))
    trimmed = lease.allocation
    assert views[id(trimmed)][1].ctypes.data == trimmed.data_ptr() == views[id(trimmed)][0]
    lease.release()
    assert pool.trim() > 0
    assert data_pointer(trimmed) != views[id(trimmed)][0], "a trimmed bucket kept its view"
    del trimmed
    lease = pool.acquire(layout.total_numel, ms.float32)
    writers.pack(lease, [ms.Tensor(r) for r in raw], layout, host=True)
    allocation, key = weakref.ref(lease.allocation), id(lease.allocation)
    assert key in views
    lease.release()
    del lease, pool
    gc.collect()
    assert allocation() is None, "the host view kept a dropped pool's bucket alive"
    assert key not in views, "a freed bucket's host view outlived it"


def test_bucket_array_is_the_bucket_and_refuses_a_released_lease():
    pool = BucketPool(device="CPU", alignment_bytes=4)
    lease = pool.acquire(6, ms.float32)
    array = host_writer().bucket_array(lease)
    assert array.shape == (6,) and array.ctypes.data == lease.allocation.data_ptr()
    array[:] = 3.0
    assert (lease.tensor.asnumpy() == 3.0).all()      # writes land in the bucket
    lease.release()
    with pytest.raises(LeaseStateError, match="released"):
        host_writer().bucket_array(lease)


def test_the_host_view_follows_a_bucket_whose_memory_moved():
    """MindSpore may give a tensor new memory; the host writer's cached view of the bucket must
    then be rebuilt over the new memory, never written through the old pointer."""
    pool = BucketPool(device="CPU", alignment_bytes=4)
    lease = pool.acquire(8, ms.float32)
    old = host_writer().bucket_array(lease)
    record = pool._buckets[0]
    # Move the storage the way a regrow does: free it, then grow it again at a new address.
    record.tensor.untyped_storage().resize_(0)
    keep = [ms.mint.zeros(8, dtype=ms.float32) for _ in range(4)]   # take the freed block
    for tensor in keep:
        tensor.untyped_storage().data_ptr()
    record.tensor.untyped_storage().resize_(8 * 4)
    if record.tensor.data_ptr() == old.ctypes.data:
        pytest.skip("the regrown storage landed at the same address")
    new = host_writer().bucket_array(lease)
    assert new.ctypes.data == record.tensor.data_ptr()
    new[:] = 5.0
    assert (lease.tensor.asnumpy() == 5.0).all()
    del keep


# -- the identity layout --------------------------------------------------------------------------
@pytest.mark.parametrize("bucket_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("grad_dtype", ["float32", "float16", "bfloat16"])
def test_identity_layout_pack_then_accumulate_on_the_host(grad_dtype, bucket_dtype):
    """A single evenly sharded gradient is the bucket itself (the identity layout, the host
    path's one-call branch): a pack casts it in, an accumulate adds to it, for every dtype pair
    (NumPy's float32 sum rounded once is the reference)."""
    layout = ReduceScatterLayout.build([(8, 4)], 2, 1)
    assert layout.is_identity()
    rng = np.random.default_rng(35)
    first, second = (round_to(normal(rng, (8, 4)), grad_dtype) for _ in range(2))
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(layout.total_numel,
                                                                getattr(ms, bucket_dtype))

    def as_grad(array):
        return ms.Tensor(array).astype(getattr(ms, grad_dtype))

    assert writers.pack(lease, [as_grad(first)], layout, host=True).on_host
    packed = round_to(first.reshape(-1), bucket_dtype)
    np.testing.assert_array_equal(values(lease.tensor), packed)
    writers.accumulate(lease, [as_grad(second)], layout, host=True)
    np.testing.assert_array_equal(values(lease.tensor),
                                  add_rounded(packed, second.reshape(-1), bucket_dtype))
    lease.release()


# -- the compiled float32 -> bfloat16 cast, with a stand-in kernel --------------------------------
def _reference_kernel(calls):
    """Stands in for the numba kernel, so the call contract is checked apart from numba: called
    with (1-D uint32 words of float32, 1-D uint16 out, the streaming threshold in bytes), it
    writes MindSpore's result (round to nearest even, every NaN 0x7FC0), computed with ml_dtypes."""

    def kernel(words, out, stream_from_bytes):
        assert stream_from_bytes == STREAM_FROM_BYTES
        assert (words.dtype, out.dtype, words.ndim, out.ndim) == (np.uint32, np.uint16, 1, 1)
        assert words.size == out.size
        calls.append(words.size)
        values = words.view(np.float32)
        out[:] = np.where(np.isnan(values), np.uint16(0x7FC0),
                          values.astype(ml_dtypes.bfloat16).view(np.uint16))
    return kernel


def test_compiled_cast_writes_only_a_contiguous_float32_to_bfloat16_pair(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "bfloat16_kernel", lambda: _reference_kernel(calls))
    rng = np.random.default_rng(31)
    src = rng.standard_normal((3, 4)).astype(np.float32)
    src[0, 1], src[1, 2], src[2, 3] = np.nan, np.inf, -np.nan
    dst = np.zeros((3, 4), ml_dtypes.bfloat16)
    assert views.compiled_cast(dst, src) is True
    expected = src.astype(ml_dtypes.bfloat16).view(np.uint16)
    expected[np.isnan(src)] = 0x7FC0
    np.testing.assert_array_equal(dst.view(np.uint16), expected)
    assert calls == [12]
    wide = np.zeros((3, 8), ml_dtypes.bfloat16)
    refused = [
        (np.zeros((3, 4), np.float16), src),                      # not bfloat16
        (np.zeros((3, 4), ml_dtypes.bfloat16), src.astype(np.float16)),   # not float32
        (np.zeros(12, ml_dtypes.bfloat16), src),                  # another shape
        (wide[:, ::2], src),                                      # non-contiguous dst
        (np.zeros((3, 2), ml_dtypes.bfloat16), src[:, ::2]),      # non-contiguous src
    ]
    for out, values in refused:
        before = out.copy()
        assert views.compiled_cast(out, values) is False
        np.testing.assert_array_equal(out.view(np.uint16), before.view(np.uint16))
    assert calls == [12]


def test_compiled_cast_without_numba_writes_nothing(monkeypatch, caplog):
    """Where numba cannot be imported the compiled cast declines, writes nothing and says so
    once (the pack then casts with ml_dtypes)."""
    monkeypatch.setitem(sys.modules, "numba", None)      # import numba raises ImportError
    kernels.bfloat16_kernel.cache_clear()
    kernels._address_writers.cache_clear()
    kernels.compile_host_loops.cache_clear()
    try:
        dst = np.zeros(4, ml_dtypes.bfloat16)
        with caplog.at_level("WARNING", logger="gradpool.host.kernels"):
            assert views.compiled_cast(dst, np.ones(4, np.float32)) is False
            assert views.compiled_cast(dst, np.ones(4, np.float32)) is False
            assert kernels.address_writer("float32", "bfloat16") is None
            assert kernels.address_writer("float32", "float32") is None
            assert kernels.compile_host_loops() is False
        assert not dst.view(np.uint16).any()
        warned = [r.getMessage() for r in caplog.records if "numba" in r.getMessage()]
        assert len(warned) == 1 and "ml-dtypes" in warned[0], warned
    finally:
        kernels.bfloat16_kernel.cache_clear()
        kernels._address_writers.cache_clear()
        kernels.compile_host_loops.cache_clear()


def test_compiled_writer_is_looked_up_once_per_pair_of_supported_dtype_objects(monkeypatch):
    """compiled_writer caches by the id() of the dtype objects, so it caches only the supported
    singletons (another object's id may be reused by a later one) and returns the cached writer,
    with both element sizes, on every later call."""
    monkeypatch.setattr(views, "_WRITERS", {})
    stranger = object()
    assert views.compiled_writer(stranger, ms.float32) is None
    assert views.compiled_writer(ms.float32, stranger) is None
    assert views._WRITERS == {}
    writer = views.compiled_writer(ms.bfloat16, ms.float32)
    assert (writer.src_itemsize, writer.dst_itemsize) == (2, 4)
    assert views._WRITERS == {(id(ms.bfloat16), id(ms.float32)): writer}
    assert views.compiled_writer(ms.bfloat16, ms.float32) is writer
    assert views.compiled_writer(ms.float16, ms.float32) is None       # no writer for the pair


def test_the_compiled_cast_serves_a_pack_never_an_accumulate(monkeypatch):
    """Without the address writers (a gradient they cannot take), the compiled float32 ->
    bfloat16 cast (a stand-in kernel here) writes an identity-layout host pack; an accumulate
    must add, so it never does."""
    calls = []
    monkeypatch.setattr(kernels, "bfloat16_kernel", lambda: _reference_kernel(calls))
    _without_address_writers(monkeypatch)
    layout = ReduceScatterLayout.build([(16,)], 2, 1)
    rng = np.random.default_rng(36)
    first, second = normal(rng, (16,)), normal(rng, (16,))
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(16, ms.bfloat16)
    writers.pack(lease, [ms.Tensor(first)], layout, host=True)
    assert calls == [16]
    np.testing.assert_array_equal(values(lease.tensor), round_to(first, "bfloat16"))
    writers.accumulate(lease, [ms.Tensor(second)], layout, host=True)
    assert calls == [16]
    np.testing.assert_array_equal(values(lease.tensor),
                                  add_rounded(round_to(first, "bfloat16"), second, "bfloat16"))
    lease.release()


# -- the compiled address writers and the single-gradient pack ------------------------------------
def _recorded_address_writers(monkeypatch, calls):
    """The real compiled address writers, each call recorded as (src dtype, dst dtype, numel)."""
    real = kernels.address_writer

    def recording(src, dst):
        write = real(src, dst)
        if write is None:
            return None

        def recorded(dst_address, src_address, numel):
            calls.append((src, dst, numel))
            write(dst_address, src_address, numel)
        return recorded
    monkeypatch.setattr(kernels, "address_writer", recording)
    monkeypatch.setattr(views, "_WRITERS", {})


def _without_address_writers(monkeypatch):
    """No compiled address writer for any pair (as without numba): the NumPy host path."""
    monkeypatch.setattr(kernels, "address_writer", lambda src, dst: None)
    monkeypatch.setattr(views, "_WRITERS", {})


_WRITER_PAIRS = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
                 ("float32", "bfloat16"), ("bfloat16", "float32")]


@pytest.mark.parametrize("grad_dtype,bucket_dtype", _WRITER_PAIRS)
def test_the_address_writers_serve_a_pack_never_an_accumulate(monkeypatch, grad_dtype,
                                                              bucket_dtype):
    """An identity-layout host pack of one contiguous gradient writes through the pair's
    compiled address writer; an accumulate must add, so it never does."""
    calls = []
    _recorded_address_writers(monkeypatch, calls)
    layout = ReduceScatterLayout.build([(16,)], 2, 1)
    rng = np.random.default_rng(37)
    first, second = (round_to(normal(rng, (16,)), grad_dtype) for _ in range(2))
    as_grad = lambda a: ms.Tensor(a).astype(getattr(ms, grad_dtype))   # noqa: E731
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(16, getattr(ms, bucket_dtype))
    written = writers.pack(lease, [as_grad(first)], layout, host=True)
    assert calls == [(grad_dtype, bucket_dtype, 16)]
    assert written.nbytes == lease.nbytes and written.on_host
    packed = round_to(first, bucket_dtype)
    np.testing.assert_array_equal(values(lease.tensor), packed)
    writers.accumulate(lease, [as_grad(second)], layout, host=True)
    assert len(calls) == 1
    np.testing.assert_array_equal(values(lease.tensor),
                                  add_rounded(packed, second, bucket_dtype))
    lease.release()


@pytest.mark.parametrize("numel", [32, 31])
@pytest.mark.parametrize("writers", ["address-writers", "numpy"])
def test_a_gradient_over_its_own_bucket_is_read_before_it_is_overwritten(monkeypatch, writers,
                                                                         numel):
    """A gradient whose memory overlaps the bucket (a bfloat16 tensor over the first half of a
    float32 bucket) is cast from a copy, by the address writer and by NumPy alike: widening in
    place would overwrite gradient elements 2i and 2i + 1 with element i before reading them
    (NumPy buffers an overlapping 1-D copy only for negative strides). The copy is of all the
    gradient's bytes: zero bytes early in it (2.0 and 0.0 as bfloat16), and an odd length
    (62 bytes, no whole number of 8-byte words)."""
    calls = []
    _recorded_address_writers(monkeypatch, calls)
    if writers == "numpy":
        _without_address_writers(monkeypatch)
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(numel, ms.float32)
    halves = np.frombuffer((ctypes.c_char * (2 * numel)).from_address(lease.allocation.data_ptr()),
                           np.int16)
    source = np.random.default_rng(38).standard_normal(numel).astype(np.float32)
    source[1], source[5] = 2.0, 0.0
    halves[:] = (source.view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
    grad = ms.from_numpy(halves).view(ms.bfloat16)
    assert grad.data_ptr() == lease.allocation.data_ptr()
    writing.pack(lease, [grad], ReduceScatterLayout.build([(numel,)], 1, 1), host=True)
    assert calls == ([("bfloat16", "float32", numel)] if writers == "address-writers" else [])
    want = ((source.view(np.uint32) >> 16) << 16).view(np.float32)
    np.testing.assert_array_equal(values(lease.tensor), want)
    lease.release()


@pytest.mark.parametrize("writers", ["address-writers", "numpy"])
def test_a_single_gradient_host_pack_refuses_a_shape_or_lease_that_does_not_fit(monkeypatch,
                                                                                 writers):
    """The single-gradient host path writes only a gradient of the layout's shape into a lease
    of the layout's size: a gradient of the same element count but another shape, or a lease of
    another size, is refused as the general path refuses it, and nothing is written."""
    if writers == "numpy":
        _without_address_writers(monkeypatch)
    layout = ReduceScatterLayout.build([(16,)], 1, 1)
    pool = BucketPool(device="CPU", alignment_bytes=4)
    lease = pool.acquire(16, ms.float32)
    before = values(lease.tensor).copy()
    folded = ms.Tensor(np.ones((2, 8), np.float32))
    with pytest.raises(LayoutMismatchError, match=r"shape \(2, 8\); the layout expects \(16,\)"):
        writing.pack(lease, [folded], layout, host=True)
    np.testing.assert_array_equal(values(lease.tensor), before)
    lease.release()
    pool.acquire(32, ms.float32).release()
    longer = pool.acquire(32, ms.float32)
    with pytest.raises(LayoutMismatchError, match="lease holds 32 elements; the layout needs 16"):
        writing.pack(longer, [ms.Tensor(np.ones(16, np.float32))], layout, host=True)
    longer.release()


@pytest.mark.parametrize("writers", ["address-writers", "numpy"])
@pytest.mark.parametrize("grad_dtype,bucket_dtype", _WRITER_PAIRS + [("float16", "float32"),
                                                                     ("float32", "float16")])
def test_a_single_gradient_host_pack_reports_what_it_wrote(monkeypatch, writers, grad_dtype,
                                                           bucket_dtype):
    """Written of a single-gradient host pack, on either host path: the bucket's bytes, no
    padding, written on the host."""
    if writers == "numpy":
        _without_address_writers(monkeypatch)
    lease = BucketPool(device="CPU", alignment_bytes=4).acquire(24, getattr(ms, bucket_dtype))
    grad = ms.Tensor(np.linspace(-3, 3, 24, dtype=np.float32)).astype(getattr(ms, grad_dtype))
    written = writing.pack(lease, [grad], ReduceScatterLayout.build([(24,)], 2, 1), host=True)
    assert written == packing.Written(24 * (4 if bucket_dtype == "float32" else 2), 0, True)
    lease.release()
