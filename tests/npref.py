"""NumPy references and tensor read-back helpers shared by the tests.

The references round exactly as the code under test must: a cast to float16 or bfloat16 is
round-to-nearest-even of the float32 value (NumPy's cast, ``ml_dtypes.bfloat16``'s cast; measured
equal to MindSpore 2.10's CPU cast and ``copy_``), and every sum of two values is the float32 sum
rounded once into the destination dtype (a float32 sum of two float16/bfloat16 values rounded to
that dtype is the correctly rounded sum: float32 has more than 2p+2 bits for both).
"""
import ml_dtypes
import numpy as np

DTYPE_NAMES = ("float32", "float16", "bfloat16")
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def name_of(dtype) -> str:
    """``"float32"``/``"float16"``/``"bfloat16"`` for a MindSpore dtype or a name."""
    return str(dtype).lower()


def round_to(values, dtype) -> np.ndarray:
    """``values`` rounded (nearest even) to ``dtype``, returned as float32 (exact for all three)."""
    values = np.asarray(values, dtype=np.float32)
    return values.astype(_NP[name_of(dtype)]).astype(np.float32)


def add_rounded(acc, values, dtype) -> np.ndarray:
    """``acc + values`` computed in float32 and rounded once into ``dtype`` (an accumulate)."""
    return round_to(np.asarray(acc, np.float32) + np.asarray(values, np.float32), dtype)


def wire_dtype(dtype) -> str:
    """The dtype the CPU collectives sum in: bfloat16 travels as float32, the rest as themselves."""
    return "float32" if name_of(dtype) == "bfloat16" else name_of(dtype)


def reduce_over_ranks(per_rank, dtype, op: str, world: int) -> np.ndarray:
    """What a sum/avg collective over ``world`` ranks leaves, element by element: rank values
    (already in ``dtype``) summed in rank order in the wire dtype, divided by ``world`` there for
    "avg", rounded to ``dtype``. With one rank nothing is summed or divided (the identity)."""
    wire = _NP[wire_dtype(dtype)]
    total = np.asarray(per_rank[0], np.float32).astype(wire)
    for values in per_rank[1:]:
        total = (total + np.asarray(values, np.float32).astype(wire)).astype(wire)
    if op == "avg" and world > 1:
        total = (total / wire(world)).astype(wire)
    return round_to(total.astype(np.float32), dtype)


def np_chunk(full, dim: int, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s chunk of ``full`` along ``dim``, zero-padded to ceil(d / W) entries."""
    full = np.asarray(full)
    chunk = -(-full.shape[dim] // world)
    widths = [(0, 0)] * full.ndim
    widths[dim] = (0, chunk * world - full.shape[dim])
    padded = np.pad(full, widths)
    return np.take(padded, range(rank * chunk, (rank + 1) * chunk), axis=dim)


def np_local(managed, full) -> np.ndarray:
    """What a managed parameter's rank holds of ``full`` (a NumPy array of the whole tensor):
    all of it when replicated, else its chunk (zero-padded)."""
    if managed.replicate:
        return full
    return np_chunk(full, managed.shard_dim, managed.rank, managed.world_size)


def np_pack(grads, layout, dtype=None):
    """Pack per the layout with NumPy: the reference for what gradpool.pack must produce. With
    ``dtype`` every value is rounded to it (as the pack casts), as float32; else float64."""
    out_dtype = np.float32 if dtype is not None else np.float64
    bucket = np.zeros(layout.total_numel, dtype=out_dtype)
    for slot, grad in zip(layout.slots, grads):
        grad = round_to(grad, dtype) if dtype is not None else np.asarray(grad, np.float64)
        padded = np.zeros(slot.padded_shape, dtype=out_dtype)
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


def normal(rng, shape) -> np.ndarray:
    """Random standard-normal float32 values: not exact in float16 or bfloat16, so a pack that
    rounds, truncates or drops a bit changes them."""
    return rng.standard_normal(shape).astype(np.float32)
