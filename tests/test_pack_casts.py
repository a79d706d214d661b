"""Casts while packing are bit-exact with MindSpore's own cast, on both copy paths.

Every bfloat16 and float16 bit pattern, and float32 patterns chosen to hit every rounding case
(random words, ties to even, one below and above a tie, subnormals, NaN payloads of both signs,
+-inf, overflow), are packed into a bucket of each other dtype. The bucket's bits must equal
MindSpore's ``astype`` of the same tensor and an independent NumPy integer reference of round to
nearest even (NaN written as one canonical quiet NaN, inf kept)."""
import mindspore as ms
import numpy as np
import pytest

from gradpool import writers
from gradpool.layout import ReduceScatterLayout
from gradpool.pool import BucketPool
from npref import raw_bytes

ms.set_device("CPU")

_UINT = {ms.float32: np.uint32, ms.float16: np.uint16, ms.bfloat16: np.uint16}
_INT = {ms.float32: np.int32, ms.float16: np.int16, ms.bfloat16: np.int16}


@pytest.fixture(params=["host-addresses", "host-numpy", "device-copies"])
def host(request, monkeypatch):
    """The three copy paths: on the host, a single gradient whose bucket is the flat gradient is
    written by a compiled writer between the two addresses ("host-addresses"); with those
    writers unavailable (as without numba) NumPy and ml-dtypes write it ("host-numpy"); the
    device path writes with MindSpore's ops."""
    if request.param == "host-numpy":
        without_address_writers(monkeypatch)
    return request.param != "device-copies"


def without_address_writers(monkeypatch):
    from gradpool.host import kernels, views
    monkeypatch.setattr(kernels, "address_writer", lambda src, dst: None)
    monkeypatch.setattr(views, "_WRITERS", {})


def bits_of(tensor):
    return np.frombuffer(raw_bytes(tensor), _UINT[tensor.dtype]).copy()


def tensor_of(bits, dtype):
    """A ``dtype`` tensor holding exactly ``bits`` (built from integers, no cast involved)."""
    return ms.Tensor(np.ascontiguousarray(bits).view(_INT[dtype])).view(dtype)


def all_16bit_patterns():
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def float32_patterns():
    rng = np.random.default_rng(12)
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    words = [rng.integers(0, 1 << 32, size=1 << 17, dtype=np.uint64).astype(np.uint32),
             high | 0x8000, high | 0x7FFF, high | 0x8001, high | 0x1000,     # ties and neighbours
             rng.integers(1, 0x00800000, size=4096, dtype=np.uint32),        # subnormals
             rng.integers(1, 0x00800000, size=4096, dtype=np.uint32) | 0x80000000,
             0x7F800000 | rng.integers(1, 0x00800000, size=4096, dtype=np.uint32),  # NaN payloads
             0xFF800000 | rng.integers(1, 0x00800000, size=4096, dtype=np.uint32),
             np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
                       0x7F7FFFFF, 0xFF7FFFFF, 0x477FF000, 0x477FEFFF, 0x38800000, 0x33800000,
                       0x33000001, 0, 0x80000000], dtype=np.uint32)]
    return np.concatenate(words)


def rne_bfloat16(words):
    """float32 words -> bfloat16 bits: round to nearest even; every NaN -> 0x7FC0."""
    words = words.astype(np.uint64)
    rounded = ((words + 0x7FFF + ((words >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (words & 0x7FFFFFFF) > 0x7F800000
    rounded[nan] = 0x7FC0
    return rounded


def pack_bits(bits, grad_dtype, bucket_dtype, host, world=1):
    """Pack one gradient holding ``bits`` into a fresh ``bucket_dtype`` bucket; its bits."""
    grad = tensor_of(bits, grad_dtype)
    layout = ReduceScatterLayout.build([(bits.size,)], world)
    lease = BucketPool(alignment_bytes=4).acquire(layout.total_numel, bucket_dtype)
    written = writers.pack(lease, [grad], layout, host=host)
    assert written.on_host == host
    out = bits_of(lease.tensor)
    lease.release()
    return out


PAIRS_16 = [(ms.bfloat16, ms.float32), (ms.bfloat16, ms.float16), (ms.bfloat16, ms.bfloat16),
            (ms.float16, ms.bfloat16), (ms.float16, ms.float32), (ms.float16, ms.float16)]


@pytest.mark.parametrize("grad_dtype,bucket_dtype", PAIRS_16, ids=str)
def test_every_16bit_pattern_casts_as_mindspore_does(host, grad_dtype, bucket_dtype):
    bits = all_16bit_patterns()
    want = bits_of(tensor_of(bits, grad_dtype).astype(bucket_dtype))
    got = pack_bits(bits, grad_dtype, bucket_dtype, host)
    np.testing.assert_array_equal(got, want)
    if grad_dtype == bucket_dtype:
        np.testing.assert_array_equal(got, bits)


def test_bfloat16_to_float32_is_the_high_half():
    """Independent of MindSpore: widening bfloat16 is ``bits << 16`` exactly, NaNs included."""
    bits = all_16bit_patterns()
    got = pack_bits(bits, ms.bfloat16, ms.float32, host=True)
    np.testing.assert_array_equal(got, bits.astype(np.uint32) << 16)


@pytest.mark.parametrize("bucket_dtype", [ms.bfloat16, ms.float16], ids=str)
def test_float32_patterns_round_to_nearest_even(host, bucket_dtype):
    words = float32_patterns()
    want = bits_of(ms.Tensor(words.view(np.float32)).astype(bucket_dtype))
    got = pack_bits(words, ms.float32, bucket_dtype, host)
    np.testing.assert_array_equal(got, want)
    # and against NumPy references that do not go through MindSpore
    if bucket_dtype == ms.bfloat16:
        np.testing.assert_array_equal(got, rne_bfloat16(words))
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            ref = words.view(np.float32).astype(np.float16).view(np.uint16)
        nan = np.isnan(words.view(np.float32))
        np.testing.assert_array_equal(got[~nan], ref[~nan])
        np.testing.assert_array_equal(got[nan], (ref[nan] & 0x8000) | 0x7E00)


@pytest.mark.parametrize("bucket_dtype", [ms.bfloat16, ms.float16], ids=str)
def test_cast_into_interleaved_uneven_layout(host, bucket_dtype):
    """Random float32 (NaNs and infs among them) into a world-3 layout with an uneven Shard(1)
    gradient and alignment gaps: each chunk holds MindSpore's cast of the gradient's chunk."""
    rng = np.random.default_rng(5)
    words = rng.choice(float32_patterns(), size=(4, 10))
    shapes = [(4, 10), (7,)]
    arrays = [words.view(np.float32), rng.standard_normal(7).astype(np.float32)]
    layout = ReduceScatterLayout.build(shapes, 3, alignment=8, shard_dims=[1, 0])
    pool = BucketPool(alignment_bytes=4, poison_on_release=True)
    pool.acquire(layout.total_numel, bucket_dtype).release()       # poisoned: gaps must be zeroed
    lease = pool.acquire(layout.total_numel, bucket_dtype)
    writers.pack(lease, [ms.Tensor(a) for a in arrays], layout, host=host)
    got = bits_of(lease.tensor)
    want = np.zeros(layout.total_numel, np.uint16)
    for slot, array in zip(layout.slots, arrays):
        cast = bits_of(ms.Tensor(array).astype(bucket_dtype)).reshape(slot.shape)
        padded = np.zeros(slot.padded_shape, np.uint16)
        padded[tuple(slice(0, d) for d in slot.shape)] = cast
        for rank in range(3):
            chunk = np.take(padded, range(rank * slot.chunk_size, (rank + 1) * slot.chunk_size),
                            axis=slot.shard_dim)
            start, end = layout.flat_range(slot.index, rank)
            want[start:end] = chunk.reshape(-1)
    np.testing.assert_array_equal(got, want)
    lease.release()


def test_accumulate_into_bfloat16_rounds_once(host):
    """float32 micro-steps into a bfloat16 bucket: the float32 sum of the bucket's value and the
    new gradient, rounded once to nearest even (values chosen so rounding twice differs)."""
    rng = np.random.default_rng(21)
    first, second = (rng.standard_normal(4096).astype(np.float32) for _ in range(2))
    layout = ReduceScatterLayout.build([(4096,)], 1)
    lease = BucketPool(alignment_bytes=4).acquire(4096, ms.bfloat16)
    writers.pack(lease, [ms.Tensor(first)], layout, host=host)
    writers.accumulate(lease, [ms.Tensor(second)], layout, host=host)
    stored = (rne_bfloat16(first.view(np.uint32)).astype(np.uint32) << 16).view(np.float32)
    want = rne_bfloat16((stored + second).view(np.uint32))
    twice = rne_bfloat16(((rne_bfloat16(second.view(np.uint32)).astype(np.uint32) << 16)
                          .view(np.float32) + stored).view(np.uint32))
    assert (want != twice).any(), "the data must tell the two roundings apart"
    np.testing.assert_array_equal(bits_of(lease.tensor), want)
    lease.release()


@pytest.mark.parametrize("grad_dtype", [ms.float32, ms.float16, ms.bfloat16], ids=str)
@pytest.mark.parametrize("bucket_dtype", [ms.float32, ms.float16, ms.bfloat16], ids=str)
@pytest.mark.parametrize("world", [1, 2], ids=["identity", "interleaved"])
def test_no_floating_point_warning_for_any_pattern(grad_dtype, bucket_dtype, world):
    """NaN (signalling ones too), inf and out-of-range values are cast as MindSpore casts them,
    silently: the host path warns for no pattern, whichever write it takes (one-pass identity
    copy or chunked), pack and accumulate alike."""
    import warnings
    bits = float32_patterns() if grad_dtype == ms.float32 else all_16bit_patterns()
    grad = tensor_of(bits, grad_dtype)
    layout = ReduceScatterLayout.build([(bits.size,)], world)
    lease = BucketPool(alignment_bytes=4).acquire(layout.total_numel, bucket_dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        writers.pack(lease, [grad], layout, host=True)
        writers.accumulate(lease, [grad], layout, host=True)
    lease.release()


@pytest.fixture(params=["ordinary", "streaming"])
def store(request, monkeypatch):
    """The compiled writers' two store kinds: below ``STREAM_FROM_BYTES`` (the cast) and
    ``COPY_STREAM_FROM_BYTES`` (the copy) ordinary stores, from there on non-temporal vector
    stores (both set to 0 here, so small outputs take that path too)."""
    if request.param == "streaming":
        from gradpool.host import kernels
        monkeypatch.setattr(kernels, "STREAM_FROM_BYTES", 0)
        monkeypatch.setattr(kernels, "COPY_STREAM_FROM_BYTES", 0)
    return request.param


def test_compiled_float32_to_bfloat16_cast_is_round_to_nearest_even(store):
    """The compiled cast (numba) writes the integer reference's bits for every float32 rounding
    case, NaNs as 0x7FC0."""
    import ml_dtypes
    from gradpool.host.views import compiled_cast
    words = float32_patterns()
    out = np.empty(words.size, ml_dtypes.bfloat16)
    assert compiled_cast(out, words.view(np.float32))
    np.testing.assert_array_equal(out.view(np.uint16), rne_bfloat16(words))


@pytest.mark.parametrize("length",
                         [1, 2, 3, 4, 15, 16, 17, 33, 16 * 6 + 5, 16 * 7 + 3, 4096 + 3])
@pytest.mark.parametrize("offset", [0, 1, 7, 15], ids=lambda o: f"{2 * o}-bytes-into-a-32-byte-line")
def test_compiled_cast_of_any_length_at_any_alignment(length, offset, store):
    """Any length, also on an output that starts between two 32-bit words or anywhere in a
    32-byte line (the streaming stores start at the first line boundary): the bits of the
    integer reference, and nothing written outside the output."""
    import ml_dtypes
    from gradpool.host.views import compiled_cast
    words = float32_patterns()[:length] if length <= 4096 else float32_patterns()[-length:]
    backing = np.full(length + 32, 0x1234, np.uint16)
    start = offset + (-backing.ctypes.data % 32) // 2     # offset elements past a 32-byte line
    out = backing[start:start + length].view(ml_dtypes.bfloat16)
    assert out.ctypes.data % 32 == 2 * offset
    assert compiled_cast(out, words.view(np.float32))
    np.testing.assert_array_equal(out.view(np.uint16), rne_bfloat16(words))
    assert (np.delete(backing, np.arange(start, start + length)) == 0x1234).all()


def test_compiled_cast_at_an_odd_address_takes_the_ordinary_loop(monkeypatch):
    """A uint16 view at an odd address (a byte buffer's) cannot be aligned for vector stores:
    the ordinary loop writes it (a vector store there would fault)."""
    import ml_dtypes
    from gradpool.host import kernels, views
    monkeypatch.setattr(kernels, "STREAM_FROM_BYTES", 0)
    words = float32_patterns()[:1000]
    raw = np.zeros(2 * words.size + 64, np.uint8)
    start = 1 + (-raw.ctypes.data % 32)
    out = raw[start:start + 2 * words.size].view(ml_dtypes.bfloat16)
    assert out.ctypes.data % 2 == 1
    assert views.compiled_cast(out, words.view(np.float32))
    np.testing.assert_array_equal(out.view(np.uint16), rne_bfloat16(words))


def test_compiled_cast_takes_only_contiguous_float32_to_bfloat16():
    import ml_dtypes
    from gradpool.host.views import compiled_cast
    src = np.ones(8, np.float32)
    untouched = np.zeros(8, np.float16)
    assert not compiled_cast(untouched, src)
    assert not compiled_cast(np.zeros(4, ml_dtypes.bfloat16), src[::2])
    assert not compiled_cast(np.zeros(8, ml_dtypes.bfloat16), src.astype(ml_dtypes.bfloat16))
    assert not untouched.any()


def test_float32_to_bfloat16_without_the_compiled_cast(monkeypatch):
    """Without numba (where it cannot be imported) the one-pass ml_dtypes cast, plus NaN
    canonicalization, writes the same bits."""
    from gradpool.host import kernels
    monkeypatch.setattr(kernels, "bfloat16_kernel", lambda: None)
    without_address_writers(monkeypatch)
    words = float32_patterns()
    got = pack_bits(words, ms.float32, ms.bfloat16, host=True)
    np.testing.assert_array_equal(got, rne_bfloat16(words))


@pytest.mark.parametrize("length", [1, 3, 16, 17, 4099, 16411])
@pytest.mark.parametrize("offset", [0, 1, 5, 9], ids=lambda o: f"{o}-elements-past-a-64-byte-line")
@pytest.mark.parametrize("src_name,dst_name", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float16"),
    ("bfloat16", "float32"), ("float32", "bfloat16")])
def test_address_writer_writes_exactly_its_elements(src_name, dst_name, length, offset, store):
    """Each compiled address writer, at any length, with its output anywhere in a 64-byte cache
    line (the streaming stores start at the first line boundary) and either store kind: the bits
    of the integer references, and no byte before or after the output written. 16,411 elements
    are several blocks of the streaming copy's four pages (16 KiB each) and a tail."""
    from gradpool.host.kernels import address_writer
    write = address_writer(src_name, dst_name)
    assert write is not None
    if src_name == "float32":
        source = float32_patterns()[-length:]
        want = source if dst_name == "float32" else rne_bfloat16(source)
    else:
        source = np.resize(all_16bit_patterns()[::-7], length)
        want = source if dst_name == src_name else source.astype(np.uint32) << 16
    want = np.ascontiguousarray(want)
    backing = np.full(length + 128 // want.itemsize, 0x5A5A, want.dtype)
    start = offset + (-backing.ctypes.data % 64) // want.itemsize
    assert (backing.ctypes.data + start * want.itemsize) % 64 == offset * want.itemsize
    write(backing[start:].ctypes.data, np.ascontiguousarray(source).ctypes.data, length)
    np.testing.assert_array_equal(backing[start:start + length], want)
    assert (np.delete(backing, np.arange(start, start + length)) == 0x5A5A).all()


@pytest.mark.parametrize("src_offset", [0, 4, 64, 2944, 4092],
                         ids=lambda o: f"source-{o}-into-a-page")
@pytest.mark.parametrize("dst_offset", [0, 4, 36], ids=lambda o: f"bucket-{o}-into-a-line")
@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_streaming_copy_from_anywhere_in_a_page_to_anywhere_in_a_line(name, src_offset,
                                                                       dst_offset, monkeypatch):
    """The streaming copy's head brings the source to a page boundary and the bucket to a cache
    line before its four-page blocks: every byte arrives, none outside the bucket is written,
    wherever the two start (several blocks and a tail: 24,603 x 4 or 49,206 x 2 bytes)."""
    from gradpool.host import kernels
    monkeypatch.setattr(kernels, "COPY_STREAM_FROM_BYTES", 0)
    write = kernels.address_writer(name, name)
    nbytes = 98412
    source = np.frombuffer(np.random.default_rng(3).bytes(nbytes + 8192), np.uint8)
    src = source[(-source.ctypes.data % 4096) + src_offset:][:nbytes]
    backing = np.full(nbytes + 256, 0xA5, np.uint8)
    start = (-backing.ctypes.data % 64) + 64 + dst_offset
    width = 4 if name == "float32" else 2
    write(backing.ctypes.data + start, src.ctypes.data, nbytes // width)
    np.testing.assert_array_equal(backing[start:start + nbytes], src)
    assert (backing[:start] == 0xA5).all() and (backing[start + nbytes:] == 0xA5).all()


def test_no_address_writer_for_a_pair_without_one():
    from gradpool.host.kernels import address_writer
    assert address_writer("float16", "float32") is None
    assert address_writer("float32", "float16") is None
    assert address_writer("bfloat16", "float16") is None


@pytest.mark.parametrize("shift", [-5, 3], ids=["destination-before", "destination-after"])
def test_address_copy_of_overlapping_ranges_is_a_move(shift, store):
    """The same-dtype address writer moves overlapping ranges as memmove does (the streaming
    loop is only taken for ranges apart), whichever store kind its size selects."""
    from gradpool.host.kernels import address_writer
    memory = np.arange(5000, dtype=np.uint32)
    src, dst, length = 100, 100 + shift, 4096
    want = memory.copy()
    want[dst:dst + length] = memory[src:src + length].copy()
    write = address_writer("float32", "float32")
    write(memory[dst:].ctypes.data, memory[src:].ctypes.data, length)
    np.testing.assert_array_equal(memory, want)
