"""Copy-in through the public reducer API at sizes around this machine's streaming thresholds
(gradpool.host.caches, as the compiled writers read them): one element below, at, and past each
threshold with an odd tail, for every dtype pair of the compiled writers, and also with the
thresholds moved to the gradient's own size. Values against NumPy, casts to and from bfloat16 by
ml_dtypes (round to nearest even), independent of the writers' own integer arithmetic."""
import ml_dtypes
import mindspore as ms
import numpy as np
import pytest

from gradpool import BucketPool, GradReducer, ReducerConfig, SingleProcessCommunicator
from gradpool.host import kernels

ms.set_device("CPU")

_WIDTH = {"float32": 4, "bfloat16": 2}
_NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
_BITS = {"float32": (ms.int32, np.uint32), "bfloat16": (ms.int16, np.uint16)}


def threshold_of(grad_dtype: str, bucket_dtype: str) -> int:
    """Bytes written from which the pair's compiled writer streams (the widening cast has no
    streaming stores: its sizes sit around the copy's threshold)."""
    if (grad_dtype, bucket_dtype) == ("float32", "bfloat16"):
        return kernels.STREAM_FROM_BYTES
    return kernels.COPY_STREAM_FROM_BYTES


def pack_through_reducer(values: np.ndarray, grad_dtype: str, bucket_dtype: str,
                         alignment_bytes: int = 4) -> np.ndarray:
    """``values`` (float32) as a ``grad_dtype`` gradient packed by ``GradReducer.pack`` into a
    ``bucket_dtype`` bucket: the bucket's bits. Buckets aligned to 4 bytes are the flat gradient
    (the single-gradient address write); 512 bytes, the default, pads most sizes here (the
    general path, which writes the gradient's contiguous runs)."""
    grad = ms.Tensor(values).astype(getattr(ms, grad_dtype))
    reducer = GradReducer(BucketPool(alignment_bytes=alignment_bytes), SingleProcessCommunicator(),
                          ReducerConfig(reduce_dtype=getattr(ms, bucket_dtype)))
    buckets = reducer.pack([grad])
    try:
        assert buckets[0].lease is not None          # copied, not borrowed
        signed, unsigned = _BITS[bucket_dtype]
        tensor = buckets[0].input_tensor
        return np.frombuffer(tensor.view(signed).asnumpy().tobytes(), unsigned)[:values.size]
    finally:
        reducer.discard(buckets)


def numpy_reference(values: np.ndarray, grad_dtype: str, bucket_dtype: str) -> np.ndarray:
    as_grad = values.astype(_NP[grad_dtype])
    return as_grad.astype(_NP[bucket_dtype]).view(_BITS[bucket_dtype][1])


PAIRS = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
         ("bfloat16", "float32")]
# bytes written relative to the threshold: one 4-byte word below, exactly at, one word past,
# past with a tail that ends inside a 32-byte vector and a 4 KiB page
AROUND = {"one-below": -4, "at": 0, "one-past": 4, "odd-tail-past": 16 * 4096 + 76}


@pytest.mark.parametrize("alignment_bytes", [4, 512], ids=["flat-bucket", "padded-bucket"])
@pytest.mark.parametrize("where", list(AROUND))
@pytest.mark.parametrize("grad_dtype,bucket_dtype", PAIRS, ids=lambda d: d)
def test_pack_around_the_machine_threshold_matches_numpy(grad_dtype, bucket_dtype, where,
                                                         alignment_bytes):
    numel = (threshold_of(grad_dtype, bucket_dtype) + AROUND[where]) // _WIDTH[bucket_dtype]
    values = np.resize(np.random.default_rng(numel).standard_normal(65521).astype(np.float32),
                       numel)
    values[::4099] *= 1e-39         # some subnormals, which the casts must round too
    got = pack_through_reducer(values, grad_dtype, bucket_dtype, alignment_bytes)
    np.testing.assert_array_equal(got, numpy_reference(values, grad_dtype, bucket_dtype))


@pytest.mark.parametrize("offset", [-2, 0, 2])
@pytest.mark.parametrize("grad_dtype,bucket_dtype", PAIRS, ids=lambda d: d)
def test_pack_with_the_threshold_moved_to_the_gradient_matches_numpy(grad_dtype, bucket_dtype,
                                                                     offset, monkeypatch):
    """The same on a small gradient with the thresholds set next to its size (another
    machine's cache): both store kinds meet at any size, not only at this machine's."""
    numel = 3 * 4096 + 6
    monkeypatch.setattr(kernels, "STREAM_FROM_BYTES", (numel + offset) * _WIDTH[bucket_dtype])
    monkeypatch.setattr(kernels, "COPY_STREAM_FROM_BYTES",
                        (numel + offset) * _WIDTH[bucket_dtype])
    values = np.random.default_rng(offset + 2).standard_normal(numel).astype(np.float32)
    got = pack_through_reducer(values, grad_dtype, bucket_dtype)
    np.testing.assert_array_equal(got, numpy_reference(values, grad_dtype, bucket_dtype))


# A fused bucket's gradients: even and uneven dim-0 shards, a 2-D one, one below the size from
# which the writer goes one rank's run at a time (writer._RUN_FROM_BYTES).
FUSED_SHAPES = [(6 * 40000,), (6 * 33000 + 1,), (96, 2048), (3, 5)]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("grad_dtype,bucket_dtype", PAIRS, ids=lambda d: d)
def test_fused_bucket_of_dim0_shards_matches_numpy(grad_dtype, bucket_dtype, world):
    """Each rank's chunk of a dim-0 shard is one contiguous run: written by the compiled writers,
    with its padding zeroed and a narrowing cast's NaNs written as MindSpore's 0x7FC0."""
    rng = np.random.default_rng(world)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in FUSED_SHAPES]
    nan_rows = grad_dtype == "float32" and bucket_dtype == "bfloat16"
    if nan_rows:
        arrays[0][::977] = np.float32(np.nan)
        arrays[0][1::977] = -np.inf
    grads = [ms.Tensor(a).astype(getattr(ms, grad_dtype)) for a in arrays]
    reducer = GradReducer(BucketPool(), SingleProcessCommunicator(),
                          ReducerConfig(reduce_dtype=getattr(ms, bucket_dtype), comm_fusion=True))
    buckets = reducer.pack(grads, world_size=world)
    try:
        assert len(buckets) == 1
        layout = buckets[0].layout
        signed, unsigned = _BITS[bucket_dtype]
        got = np.frombuffer(buckets[0].input_tensor.view(signed).asnumpy().tobytes(),
                            unsigned)[:layout.total_numel].reshape(world, layout.row_numel)
    finally:
        reducer.discard(buckets)
    want = np.zeros((world, layout.row_numel), unsigned)
    for slot, values in zip(layout.slots, arrays):
        bits = numpy_reference(values.ravel(), grad_dtype, bucket_dtype).reshape(values.shape)
        if nan_rows:
            bits = np.where(np.isnan(values), np.uint16(0x7FC0), bits)
        chunk, inner = slot.chunk_size, int(np.prod(values.shape[1:], dtype=np.int64))
        padded = np.zeros((world * chunk,) + values.shape[1:], unsigned)
        padded[:values.shape[0]] = bits
        for rank in range(world):
            want[rank, slot.offset:slot.offset + chunk * inner] = \
                padded[rank * chunk:(rank + 1) * chunk].ravel()
    np.testing.assert_array_equal(got, want)
