"""NumPy references and tensor read-back helpers shared by the tests."""
import numpy as np


def np_pack(grads, layout):
    """Pack per the layout with NumPy: the reference for what gradpool.pack must produce."""
    bucket = np.zeros(layout.total_numel, dtype=np.float64)
    for slot, grad in zip(layout.slots, grads):
        padded = np.zeros(slot.padded_shape)
        padded[tuple(slice(0, d) for d in slot.shape)] = grad
        for rank in range(layout.world_size):
            chunk = np.take(padded, range(rank * slot.chunk_size, (rank + 1) * slot.chunk_size),
                            axis=slot.shard_dim)
            start, end = layout.flat_range(slot.index, rank)
            bucket[start:end] = chunk.reshape(-1)
    return bucket


def np_shards(row, layout):
    return [row[s.offset:s.offset + s.chunk_numel].reshape(s.chunk_shape) for s in layout.slots]


def values(tensor):
    """A tensor's values as a float64 NumPy copy (bfloat16 has no NumPy dtype)."""
    import mindspore as ms
    return tensor.astype(ms.float32).asnumpy().astype(np.float64).copy()


def raw_bytes(tensor):
    """A copy of a tensor's bytes (asnumpy shares memory on CPU, so copy)."""
    import mindspore as ms
    if tensor.dtype == ms.bfloat16:
        tensor = tensor.view(ms.int16)
    return tensor.asnumpy().tobytes()


def storage_bytes(tensor):
    return tensor.untyped_storage().size()


def exact_grid(rng, shape, scale=8):
    """Random values exactly representable in bfloat16/float16 (small multiples of 1/scale)."""
    return rng.integers(-64, 64, size=shape).astype(np.float64) / scale
