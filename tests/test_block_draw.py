"""Block-by-block draws of a sharded parameter (hyper_parallel/.../fully_shard/block_draw.py):
the kept pieces of every block, placed in the chunk, give the rank's chunk NumPy slices out of
the whole tensor; every block is drawn in order and none exceeds its size. Pure index logic."""
import itertools

import numpy as np
import pytest

from hyper_parallel.platform.mindspore.fully_shard.block_draw import blocks, chunk_runs


def numpy_chunk(full: np.ndarray, shard_dim: int, world: int, rank: int) -> np.ndarray:
    """Independent reference: the rank's rows sliced out, zero-padded to ceil(d / world)."""
    size = -(-full.shape[shard_dim] // world)
    part = np.take(full, range(rank * size, min((rank + 1) * size, full.shape[shard_dim])),
                   axis=shard_dim)
    shape = list(full.shape)
    shape[shard_dim] = size
    chunk = np.zeros(shape, full.dtype)
    index = [slice(None)] * full.ndim
    index[shard_dim] = slice(0, part.shape[shard_dim])
    chunk[tuple(index)] = part
    return chunk


def assembled(shape, shard_dim, world, rank, block) -> tuple[np.ndarray, list]:
    full = np.arange(1, int(np.prod(shape)) + 1, dtype=np.int64).reshape(shape)
    flat = full.ravel()
    size = -(-shape[shard_dim] // world)
    chunk_shape = shape[:shard_dim] + (size,) + shape[shard_dim + 1:]
    chunk = np.zeros(int(np.prod(chunk_shape)), np.int64)
    drawn = list(blocks(flat.size, block, chunk_runs(shape, shard_dim, size, rank)))
    for b in drawn:
        values = flat[b.start:b.start + b.length]
        for at, to, length in b.keep:
            chunk[to:to + length] = values[at:at + length]
    return chunk.reshape(chunk_shape), drawn


CASES = [((7, 3), 0, 2), ((11, 6), 0, 2), ((6, 11), 1, 2), ((5, 7, 3), 1, 4), ((3, 4, 5), 2, 3),
         ((9,), 0, 4), ((2, 2), 0, 4), ((6, 11), 0, 1)]


@pytest.mark.parametrize("shape, shard_dim, world", CASES)
@pytest.mark.parametrize("block", [1, 4, 7, 33, 10 ** 6])
def test_blocks_rebuild_every_ranks_chunk(shape, shard_dim, world, block):
    full = np.arange(1, int(np.prod(shape)) + 1, dtype=np.int64).reshape(shape)
    for rank in range(world):
        chunk, drawn = assembled(shape, shard_dim, world, rank, block)
        np.testing.assert_array_equal(chunk, numpy_chunk(full, shard_dim, world, rank),
                                      err_msg=f"rank {rank}")
        # the whole stream is drawn, in order, never more than a block at a time
        assert [b.start for b in drawn] == list(range(0, full.size, block))
        assert sum(b.length for b in drawn) == full.size
        assert max(b.length for b in drawn) <= block


def test_a_rank_past_the_last_row_keeps_nothing_but_draws_everything():
    chunk, drawn = assembled((2, 2), 0, 4, 3, 1)       # rows 2 over 4 ranks: rank 3 is padding
    assert not chunk.any() and all(not b.keep for b in drawn) and len(drawn) == 4


def test_a_block_must_hold_an_element():
    with pytest.raises(ValueError, match="at least one element, got 0"):
        list(blocks(4, 0, []))


def test_runs_do_not_overlap_and_cover_the_real_rows():
    for shape, dim, world in CASES:
        size = -(-shape[dim] // world)
        covered = [r for rank in range(world) for r in chunk_runs(shape, dim, size, rank)]
        spans = sorted((r.source, r.source + r.length) for r in covered)
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
        assert sum(e - s for s, e in spans) == int(np.prod(shape))
