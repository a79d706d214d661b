"""gradpool.pack: every write is read back from the bucket and compared with NumPy."""
import mindspore as ms
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from gradpool import pack as packing
from gradpool import writers
from gradpool.errors import (ForeignLeaseError, InvalidArgumentError, LayoutMismatchError,
                             LeaseStateError, UnsupportedDtypeError)
from gradpool.layout import GradSlot, ReduceScatterLayout
from gradpool.comm import SingleProcessCommunicator
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig
from npref import exact_grid, np_pack, np_shards, raw_bytes, values

ms.set_device("CPU")


_PATH = {"host": True}


@pytest.fixture(params=["host-copies", "device-copies"], autouse=True)
def copy_path(request):
    """Every test runs on the CPU NumPy path and on the device (Ascend-portable) path."""
    _PATH["host"] = request.param == "host-copies"
    return request.param


def pack(lease, grads, layout):
    return writers.pack(lease, grads, layout, host=_PATH["host"])


def accumulate(lease, grads, layout):
    return writers.accumulate(lease, grads, layout, host=_PATH["host"])


DTYPES = [ms.float32, ms.float16, ms.bfloat16]
SHAPES = [[(7, 3), (16,)], [(5,)], [(9, 2, 3), (1, 4), (33,)], [(8, 4)]]


def tensors(arrays, dtype, transposed=False):
    out = []
    for a in arrays:
        if transposed and a.ndim == 2 and min(a.shape) > 1:
            # a non-contiguous view with the same shape and values
            t = ms.Tensor(np.ascontiguousarray(a.T).astype(np.float32)).astype(dtype).T
            assert not t.is_contiguous()
        else:
            t = ms.Tensor(a.astype(np.float32)).astype(dtype)
        out.append(t)
    return out


@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("bucket_dtype", DTYPES)
@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_pack_reads_back_as_numpy_pack(grad_dtype, bucket_dtype, shapes, world):
    rng = np.random.default_rng(world)
    arrays = [exact_grid(rng, s) for s in shapes]
    layout = ReduceScatterLayout.build(shapes, world, alignment=16)
    pool = BucketPool(poison_on_release=True, alignment_bytes=64)   # 16 x fp32: whole buckets
    pool.acquire(layout.total_numel, bucket_dtype).release()     # poisoned: padding must be zeroed
    lease = pool.acquire(layout.total_numel, bucket_dtype)
    pack(lease, tensors(arrays, grad_dtype, transposed=True), layout)
    np.testing.assert_array_equal(values(lease.tensor), np_pack(arrays, layout))
    lease.release()


@pytest.mark.parametrize("dtypes", [(ms.float32, ms.float32), (ms.float16, ms.float32),
                                    (ms.float32, ms.float16)])
def test_each_path_is_taken_when_selected(copy_path, dtypes, monkeypatch):
    from gradpool.host import writer as host
    from gradpool.host.writer import HostWriter
    calls = []
    # The host writer's entries: the address write (counted when it wrote: it declines a pair
    # without a compiled writer), the single-gradient one (writes, so the general one is not
    # reached) and the general writer.
    real_writer, one = host.compiled_writer, HostWriter._put_one

    def recording_writer(src, dst):
        found = real_writer(src, dst)
        if found is None:
            return None
        return found._replace(write=lambda *a: calls.append(a) or found.write(*a))
    monkeypatch.setattr(host, "compiled_writer", recording_writer)
    monkeypatch.setattr(HostWriter, "_put_one", lambda *a, **k: calls.append(a) or one(*a, **k))
    monkeypatch.setattr(HostWriter, "_write", lambda *a, **k: calls.append(a))
    grad_dtype, bucket_dtype = dtypes
    layout = ReduceScatterLayout.build([(256,)], 1)
    lease = BucketPool(alignment_bytes=4).acquire(256, bucket_dtype)
    pack(lease, [ms.Tensor(np.ones(256, np.float32)).astype(grad_dtype)], layout)
    assert len(calls) == (1 if copy_path == "host-copies" else 0)
    ascend_pool_lease = BucketPool(device="Ascend", alignment_bytes=4).acquire(256, bucket_dtype)
    pack(ascend_pool_lease, [ms.Tensor(np.ones(256, np.float32)).astype(grad_dtype)], layout)
    assert len(calls) == (1 if copy_path == "host-copies" else 0), "host path is CPU-only"


@pytest.mark.parametrize("bucket_dtype", DTYPES)
def test_pack_into_part_of_a_larger_bucket(bucket_dtype):
    """A lease smaller than its bucket is a view; the write must land and stay inside it."""
    pool = BucketPool()
    big = pool.acquire(4096, bucket_dtype)
    sentinel = np.full(4096, 3.5)
    pack(big, [ms.Tensor(sentinel.astype(np.float32))], ReduceScatterLayout.build([(4096,)], 1))
    big.release()
    layout = ReduceScatterLayout.build([(10, 3)], 2, 1)
    lease = pool.acquire(layout.total_numel, bucket_dtype)
    assert not lease.is_whole_bucket
    arrays = [exact_grid(np.random.default_rng(0), (10, 3))]
    pack(lease, tensors(arrays, ms.float32), layout)
    np.testing.assert_array_equal(values(lease.tensor), np_pack(arrays, layout))
    tail = values(lease.allocation)[layout.total_numel:]
    np.testing.assert_array_equal(tail, sentinel[layout.total_numel:])
    lease.release()


@pytest.mark.parametrize("bucket_dtype", DTYPES)
@pytest.mark.parametrize("whole", [True, False])
def test_accumulate_adds_micro_steps(bucket_dtype, whole):
    pool = BucketPool(alignment_bytes=4)
    if not whole:
        pool.acquire(8192, bucket_dtype).release()
    shapes = [(7, 3), (5,), (4, 4)]
    layout = ReduceScatterLayout.build(shapes, 2, 16, shard_dims=[0, 0, 1])
    rng = np.random.default_rng(3)
    steps = [[exact_grid(rng, s) for s in shapes] for _ in range(3)]
    lease = pool.acquire(layout.total_numel, bucket_dtype)
    assert lease.is_whole_bucket == whole
    pack(lease, tensors(steps[0], ms.float32), layout)
    for arrays in steps[1:]:
        accumulate(lease, tensors(arrays, ms.bfloat16), layout)
    want = sum(np_pack(a, layout) for a in steps)
    np.testing.assert_array_equal(values(lease.tensor), want)
    lease.release()


def test_shard_views_are_views_of_the_output():
    shapes = [(7, 3), (5,), (4, 6)]
    layout = ReduceScatterLayout.build(shapes, 2, 16, shard_dims=[0, 0, 1])
    row = np.arange(layout.row_numel, dtype=np.float32)
    out = ms.Tensor(row.copy())
    views = packing.shard_views(out, layout)
    assert [tuple(v.shape) for v in views] == [(4, 3), (3,), (4, 3)]
    for got, want in zip(views, np_shards(row, layout)):
        np.testing.assert_array_equal(values(got), want)
        assert got.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.tuples(st.integers(1, 13), st.integers(1, 4)), min_size=1, max_size=4),
       world=st.integers(1, 4), alignment=st.sampled_from([1, 16, 128]),
       dtype=st.sampled_from(DTYPES))
def test_pack_property(shapes, world, alignment, dtype):
    arrays = [exact_grid(np.random.default_rng(len(shapes)), s) for s in shapes]
    layout = ReduceScatterLayout.build(shapes, world, alignment)
    pool = BucketPool()
    lease = pool.acquire(layout.total_numel, dtype)
    pack(lease, tensors(arrays, ms.float32), layout)
    np.testing.assert_array_equal(values(lease.tensor), np_pack(arrays, layout))
    lease.release()


def test_pack_leaves_the_source_untouched_and_counts_bytes():
    pool = BucketPool()
    grad = ms.Tensor(np.arange(64, dtype=np.float32))
    before = raw_bytes(grad)
    layout = ReduceScatterLayout.build([(64,)], 1)
    lease = pool.acquire(64, ms.float32)
    written = pack(lease, [grad], layout)
    grad_view = grad.reshape(8, 8)
    assert raw_bytes(grad) == before and raw_bytes(grad_view) == before
    assert (written.nbytes, written.padding_bytes, written.on_host) == (256, 0, _PATH["host"])
    assert pool.stats().bytes_copied == 0, "the pack reports; the reducer records"
    lease.release()


def test_reducer_records_what_the_pack_wrote():
    pool = BucketPool()
    reducer = GradReducer(pool, SingleProcessCommunicator(),
                          ReducerConfig(comm_fusion=True, host_copies=_PATH["host"]))
    grads = [ms.Tensor(np.arange(64, dtype=np.float32)), ms.Tensor(np.ones(5, np.float32))]
    layout = ReduceScatterLayout.build([(64,), (5,)], 1, pool.alignment_elements(ms.float32))
    reducer.pack(grads)[0].lease.release()
    s = pool.stats()
    assert s.bytes_copied == layout.total_numel * 4 and s.copy_seconds > 0
    assert s.padding_bytes == layout.padding_numel * 4 > 0
    reducer.accumulate(reducer.pack(grads, allow_borrow=False), grads)
    assert pool.stats().padding_bytes == 2 * s.padding_bytes, "an accumulate adds no padding"


# -- bad input --------------------------------------------------------------------------------
def _setup():
    pool = BucketPool()
    lease = pool.acquire(LAYOUT.total_numel, ms.float32)
    wrong_size = pool.acquire(LAYOUT.total_numel + 1, ms.float32)
    released = pool.acquire(LAYOUT.total_numel, ms.float32)
    released.release()
    grads = [ms.Tensor(np.zeros((4, 2), np.float32)), ms.Tensor(np.zeros(3, np.float32))]
    return pool, dict(ok=lease, wrong_size=wrong_size, released=released), grads


BAD_PACKS = {
    "count": (lambda l, g: pack(l["ok"], g[:1], LAYOUT), LayoutMismatchError,
              "got 1 gradients for a layout of 2"),
    "shape": (lambda l, g: pack(l["ok"], [g[0], ms.Tensor(np.zeros(5, np.float32))], LAYOUT),
              LayoutMismatchError, "gradient 1 has shape (5,); the layout expects (3,)"),
    "dtype": (lambda l, g: pack(l["ok"], [g[0], ms.Tensor(np.zeros(3, np.int32))], LAYOUT),
              UnsupportedDtypeError, "Int32"),
    "released": (lambda l, g: accumulate(l["released"], g, LAYOUT), LeaseStateError,
                 "released"),
    "size": (lambda l, g: pack(l["wrong_size"], g, LAYOUT), LayoutMismatchError,
             "lease holds 13 elements; the layout needs 12"),
}
LAYOUT = ReduceScatterLayout.build([(4, 2), (3,)], 2, 1)


@pytest.mark.parametrize("case", sorted(BAD_PACKS))
def test_bad_pack_raises_and_leaves_stats(case):
    pool, leases, grads = _setup()
    call, error, needle = BAD_PACKS[case]
    before = pool.stats()
    with pytest.raises(error) as err:
        call(leases, grads)
    assert needle in str(err.value)
    assert pool.stats() == before


@pytest.mark.parametrize("write", ["pack", "accumulate"])
@pytest.mark.parametrize("bad", [np.ones(4, np.float32), [1.0] * 4, None],
                         ids=["ndarray", "list", "None"])
def test_a_gradient_that_is_no_tensor_is_refused_by_type_with_the_bucket_unchanged(write, bad):
    """One gradient into a bucket that is exactly the flat gradient: the layout the
    single-gradient fast paths take, which read the tensor's own attributes first."""
    pool = BucketPool(alignment_bytes=4)
    layout = ReduceScatterLayout.build([(4,)], 1, 1)
    lease = pool.acquire(4, ms.float32)
    pack(lease, [ms.Tensor(np.full(4, 2.5, np.float32))], layout)
    with pytest.raises(InvalidArgumentError) as err:
        (pack if write == "pack" else accumulate)(lease, [bad], layout)
    assert str(err.value) == (f"gradient 0 is a {type(bad).__name__}, not a mindspore Tensor; "
                              "convert it with mindspore.Tensor(...)")
    np.testing.assert_array_equal(values(lease.tensor), np.full(4, 2.5, np.float32))
    lease.release()


def test_foreign_lease_is_refused():
    pool, other = BucketPool(), BucketPool()
    lease = other.acquire(8, ms.float32)
    before = pool.stats()
    with pytest.raises(ForeignLeaseError) as err:
        pool.release(lease)
    assert f"issued by pool {other.pool_id}" in str(err.value)
    assert pool.stats() == before and not lease.released


def test_accumulate_rounds_once_into_a_narrower_bucket():
    """float32 micro-step gradients into a float16 bucket: added in float32, rounded once, on
    both paths (values chosen so that rounding twice would differ)."""
    rng = np.random.default_rng(11)
    first, second = (rng.standard_normal(512).astype(np.float32) for _ in range(2))
    layout = ReduceScatterLayout.build([(512,)], 1)
    lease = BucketPool(alignment_bytes=4).acquire(512, ms.float16)
    pack(lease, [ms.Tensor(first)], layout)
    accumulate(lease, [ms.Tensor(second)], layout)
    want = (first.astype(np.float16).astype(np.float32) + second).astype(np.float16)
    twice = (first.astype(np.float16) + second.astype(np.float16)).astype(np.float16)
    assert (want != twice).any(), "the data must tell the two roundings apart"
    np.testing.assert_array_equal(lease.tensor.asnumpy(), want)


# -- one parameter's chunk geometry -----------------------------------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=4), world=st.integers(1, 5),
       data=st.data())
def test_local_shards_unshard_back_to_the_parameter(shape, world, data):
    """Shard every rank's chunk, concatenate them as an all-gather would, unshard: the parameter
    comes back bit for bit, for every shard dim and uneven sizes; each chunk is NumPy's."""
    dim = data.draw(st.integers(0, len(shape) - 1))
    slot = GradSlot.of(shape, world, dim)
    full = np.random.default_rng(len(shape) * 10 + world).standard_normal(shape).astype(np.float32)
    shards = [packing.local_shard(ms.Tensor(full), slot, rank) for rank in range(world)]
    padded = np.zeros(slot.padded_shape, np.float32)
    padded[tuple(slice(0, d) for d in shape)] = full
    for rank, shard in enumerate(shards):
        want = np.take(padded, range(rank * slot.chunk_size, (rank + 1) * slot.chunk_size),
                       axis=dim)
        assert tuple(shard.shape) == slot.chunk_shape
        np.testing.assert_array_equal(shard.asnumpy(), want)
    gathered = ms.Tensor(np.concatenate([s.asnumpy().reshape(-1) for s in shards]))
    back = packing.unshard(gathered, slot)
    assert tuple(back.shape) == tuple(shape)
    np.testing.assert_array_equal(back.asnumpy(), full)


# -- the all-gather direction: a gathered [W, row] bucket back to full tensors -----------------
GATHER_SHAPES = [[(7, 3), (16,)], [(5,)], [(9, 2, 3), (1, 4), (33,)], [(4, 6)]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", GATHER_SHAPES)
@pytest.mark.parametrize("world", [2, 3])
def test_unpack_gathered_returns_the_full_tensors_owning_their_memory(dtype, shapes, world):
    """Each rank sends its local shards packed as one row (world-1 layout of the shard shapes);
    the all-gather of those rows is the [W, row] bucket of the full tensors' layout. Unpacking it
    gives every full tensor bit for bit, in new memory: overwriting the bucket after changes
    nothing (the bucket may be recycled while autograd holds the tensors)."""
    rng = np.random.default_rng(world * 10 + len(shapes))
    dims = [len(s) - 1 if len(s) > 1 and i % 2 else 0 for i, s in enumerate(shapes)]
    fulls = [exact_grid(rng, s) for s in shapes]
    layout = ReduceScatterLayout.build(shapes, world, 16, shard_dims=dims)
    pool = BucketPool(alignment_bytes=4)
    rows = []
    for rank in range(world):
        locals_ = [packing.local_shard(t, slot, rank) for t, slot in
                   zip(tensors(fulls, dtype), layout.slots)]
        row = ReduceScatterLayout.build([tuple(t.shape) for t in locals_], 1, 16)
        assert row.row_numel == layout.row_numel
        send = pool.acquire(row.total_numel, dtype)
        pack(send, locals_, row)
        rows.append(values(send.tensor))
        send.release()
    np.testing.assert_array_equal(np.concatenate(rows), np_pack(fulls, layout))
    gathered = pool.acquire(layout.total_numel, dtype)
    pack(gathered, tensors(fulls, dtype), layout)   # what the all-gather of those rows holds
    out = writers.unpack_gathered(gathered, layout, host=_PATH["host"])
    assert [tuple(t.shape) for t in out] == [tuple(s) for s in shapes]
    assert all(t.dtype == dtype for t in out)
    pack(gathered, tensors([np.full(s, 3.0) for s in shapes], dtype), layout)   # recycled
    for got, want in zip(out, fulls):
        np.testing.assert_array_equal(values(got), want)
    gathered.release()


def test_unpack_gathered_checks_the_lease():
    layout = ReduceScatterLayout.build([(4, 2)], 2, 1)
    pool = BucketPool(alignment_bytes=4)
    lease = pool.acquire(layout.total_numel + 2, ms.float32)
    with pytest.raises(LayoutMismatchError, match="the layout needs 8"):
        writers.unpack_gathered(lease, layout, host=_PATH["host"])
    lease.release()
    with pytest.raises(LeaseStateError):
        writers.unpack_gathered(lease, layout, host=_PATH["host"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpack_gathered_copies_a_bucket_that_is_one_whole_parameter(dtype):
    """One evenly sharded parameter, no alignment gap: its block is the whole bucket, and the
    tensor returned must still be a copy, not the bucket."""
    layout = ReduceScatterLayout.build([(4, 6)], 2, 1)
    full = exact_grid(np.random.default_rng(2), (4, 6))
    lease = BucketPool(alignment_bytes=4).acquire(layout.total_numel, dtype)
    pack(lease, tensors([full], dtype), layout)
    out, = writers.unpack_gathered(lease, layout, host=_PATH["host"])
    pack(lease, tensors([np.zeros((4, 6))], dtype), layout)
    np.testing.assert_array_equal(values(out), full)
    lease.release()
