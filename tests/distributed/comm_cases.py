"""Communicator cases, run on every rank of one msrun launch (tests/test_comm_distributed.py).

Usage: ``python -m gradpool.launch --nproc 2 tests/distributed/comm_cases.py OUT_DIR [CASE ...]``.

Every rank builds every rank's input from a seed, so each rank computes the NumPy reference of
the whole collective itself. Inputs are multiples of 0.25 in [-8, 8): sums and halves over a few
ranks are exact in float16 and bfloat16, so the references are exact too.
"""
from __future__ import annotations

import time

import numpy as np

import mindspore as ms
from mindspore import mint

import gradpool.comm
from gradpool.comm import CompletedHandle, CpuMcclCommunicator, communicator_for, cpu_pieces
from gradpool.dtypes import writable_view
from gradpool.errors import CommError
from gradpool.pool import BucketPool
from gradpool.testing import FaultInjectingCommunicator
from harness import Context, Suite, allclose, equal, raises

suite = Suite("comm")

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
N = 37          # per-rank elements: odd, so nothing lines up with an alignment by accident
SENTINEL = -3.5


def rank_values(rank: int, numel: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(1000 * seed + rank)
    return rng.integers(-32, 32, size=numel).astype(np.float64) * 0.25


def tensor(values: np.ndarray, dtype) -> ms.Tensor:
    return ms.Tensor(values.astype(np.float32)).astype(dtype)


def reduced(ctx: Context, numel: int, op: str, seed: int = 0) -> np.ndarray:
    total = sum(rank_values(r, numel, seed) for r in range(ctx.world_size))
    return total / ctx.world_size if op == "avg" else total


def prefix_view(numel: int, extra: int, dtype) -> tuple[ms.Tensor, ms.Tensor]:
    """(the whole buffer filled with SENTINEL, its view [0:numel])."""
    whole = tensor(np.full(numel + extra, SENTINEL), dtype)
    return whole, whole[0:numel]


def untouched(whole: ms.Tensor, start: int, dtype) -> dict:
    tail = whole[start:]
    return allclose(tail, np.full(tail.shape[0], SENTINEL), dtype)


# -- reduce_scatter / all_gather / all_reduce, per op and dtype --------------------------------
def _reduce_scatter(op: str, dtype_name: str):
    def case(ctx: Context) -> dict:
        dtype, world = DTYPES[dtype_name], ctx.world_size
        inp = tensor(rank_values(ctx.rank, world * N), dtype)
        out = mint.zeros(N, dtype=dtype)
        handle = ctx.comm.reduce_scatter(out, inp, op=op)
        expected = reduced(ctx, world * N, op)[ctx.rank * N:(ctx.rank + 1) * N]
        return {"shard": allclose(out, expected, dtype),
                "completed": equal(handle.is_completed(), True),
                "input_unchanged": allclose(inp, rank_values(ctx.rank, world * N), dtype)}
    return case


def _all_gather(dtype_name: str):
    def case(ctx: Context) -> dict:
        dtype, world = DTYPES[dtype_name], ctx.world_size
        out = mint.zeros(world * N, dtype=dtype)
        ctx.comm.all_gather(out, tensor(rank_values(ctx.rank, N), dtype))
        expected = np.concatenate([rank_values(r, N) for r in range(world)])
        return {"gathered": allclose(out, expected, dtype)}
    return case


def _all_reduce(op: str, dtype_name: str):
    def case(ctx: Context) -> dict:
        dtype = DTYPES[dtype_name]
        t = tensor(rank_values(ctx.rank, N), dtype)
        ctx.comm.all_reduce(t, op=op)
        return {"reduced_in_place": allclose(t, reduced(ctx, N, op), dtype)}
    return case


for _dt in DTYPES:
    for _op in ("sum", "avg"):
        suite.add(f"reduce_scatter_{_op}_{_dt}", _reduce_scatter(_op, _dt))
        suite.add(f"all_reduce_{_op}_{_dt}", _all_reduce(_op, _dt))
    suite.add(f"all_gather_{_dt}", _all_gather(_dt))


# -- outputs that are prefix views of larger buffers (pool leases) ----------------------------
def _reduce_scatter_into_prefix_view(dtype_name: str):
    def case(ctx: Context) -> dict:
        dtype, world = DTYPES[dtype_name], ctx.world_size
        whole, out = prefix_view(N, 13, dtype)
        in_whole, inp = prefix_view(world * N, 7, dtype)
        writable_view(inp)[:] = writable_view(tensor(rank_values(ctx.rank, world * N), dtype))
        ctx.comm.reduce_scatter(out, inp, op="sum")
        expected = reduced(ctx, world * N, "sum")[ctx.rank * N:(ctx.rank + 1) * N]
        return {"prefix": allclose(out, expected, dtype),
                "rest_of_buffer_untouched": untouched(whole, N, dtype),
                "input_buffer_tail_untouched": untouched(in_whole, world * N, dtype)}
    return case


def _collectives_into_pool_leases(dtype_name: str):
    def case(ctx: Context) -> dict:
        dtype, world = DTYPES[dtype_name], ctx.world_size
        pool = BucketPool(alignment_bytes=512)
        src = pool.acquire(world * N, dtype)
        shard = pool.acquire(N, dtype)
        gathered = pool.acquire(world * N, dtype)
        assert not shard.is_whole_bucket, "the test needs a lease that is a prefix view"
        ctx.comm.all_gather(src.tensor, tensor(rank_values(ctx.rank, N), dtype))
        ctx.comm.reduce_scatter(shard.tensor, src.tensor, op="avg")
        ctx.comm.all_gather(gathered.tensor, shard.tensor)
        ctx.comm.all_reduce(shard.tensor, op="sum")
        every_rank = np.concatenate([rank_values(r, N) for r in range(world)])
        # Every rank's src holds the same concatenation, so its average is that concatenation
        # and rank r's shard is chunk r of it; the all-reduce then sums the ranks' chunks.
        return {"all_gather_into_lease": allclose(src.tensor, every_rank, dtype),
                "reduce_scatter_avg_into_lease": allclose(gathered.tensor, every_rank, dtype),
                "all_reduce_in_lease": allclose(
                    shard.tensor, every_rank.reshape(world, N).sum(axis=0), dtype)}
    return case


for _dt in DTYPES:
    suite.add(f"reduce_scatter_into_prefix_view_{_dt}", _reduce_scatter_into_prefix_view(_dt))
    suite.add(f"collectives_into_pool_leases_{_dt}", _collectives_into_pool_leases(_dt))


@suite.case
def reduce_scatter_from_offset_view_float32(ctx: Context) -> dict:
    """Input at a non-zero storage offset (a bucket's later part), output at one too."""
    world = ctx.world_size
    values = rank_values(ctx.rank, world * N)
    whole = tensor(np.concatenate([np.full(5, SENTINEL), values]), ms.float32)
    out_whole = tensor(np.full(N + 3, SENTINEL), ms.float32)
    ctx.comm.reduce_scatter(out_whole[3:], whole[5:], op="sum")
    expected = reduced(ctx, world * N, "sum")[ctx.rank * N:(ctx.rank + 1) * N]
    return {"shard": allclose(out_whole[3:], expected, ms.float32),
            "head_untouched": allclose(out_whole[:3], np.full(3, SENTINEL), ms.float32)}


# -- larger buckets, repeated shapes -----------------------------------------------------------
@suite.case
def reduce_scatter_large_float32(ctx: Context) -> dict:
    world, n = ctx.world_size, 1 << 18
    inp = tensor(rank_values(ctx.rank, world * n, seed=7), ms.float32)
    out = mint.zeros(n, dtype=ms.float32)
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        ctx.comm.reduce_scatter(out, inp, op="sum")
        timings.append(time.perf_counter() - start)
    expected = reduced(ctx, world * n, "sum", seed=7)[ctx.rank * n:(ctx.rank + 1) * n]
    print(f"reduce_scatter {world}x{n} fp32 seconds per call: {timings}", flush=True)
    return {"shard": allclose(out, expected, ms.float32)}


# -- collectives in several pieces (CPU_PIECE_ELEMENTS made small) ----------------------------
PIECE = 8       # N = 37 elements a rank: four whole pieces and a tail of 5, sent padded to 8


def _in_pieces(dtype_name: str):
    def case(ctx: Context) -> dict:
        dtype, world = DTYPES[dtype_name], ctx.world_size
        assert [p[1:] for p in cpu_pieces(N, PIECE)][-1] == (5, 8), "no padded tail: not a test"
        from mindspore.communication import create_group
        create_group("comm_cases_pair", list(range(world)))
        pair = CpuMcclCommunicator(group="comm_cases_pair")
        every_rank = np.concatenate([rank_values(r, N) for r in range(world)])
        saved, gradpool.comm.CPU_PIECE_ELEMENTS = gradpool.comm.CPU_PIECE_ELEMENTS, PIECE
        try:
            whole, shard = prefix_view(N, 13, dtype)
            ctx.comm.reduce_scatter(shard, tensor(rank_values(ctx.rank, world * N), dtype),
                                    op="avg")
            gathered = mint.zeros(world * N, dtype=dtype)
            ctx.comm.all_gather(gathered, tensor(rank_values(ctx.rank, N), dtype))
            in_group = mint.zeros(world * N, dtype=dtype)
            pair.all_gather(in_group, tensor(rank_values(ctx.rank, N), dtype))
            summed = tensor(rank_values(ctx.rank, N), dtype)
            ctx.comm.all_reduce(summed, op="sum")
        finally:
            gradpool.comm.CPU_PIECE_ELEMENTS = saved
        expected_shard = reduced(ctx, world * N, "avg")[ctx.rank * N:(ctx.rank + 1) * N]
        return {"reduce_scatter_avg": allclose(shard, expected_shard, dtype),
                "rest_of_buffer_untouched": untouched(whole, N, dtype),
                "all_gather": allclose(gathered, every_rank, dtype),
                "all_gather_in_a_sub_group": allclose(in_group, every_rank, dtype),
                "all_reduce_in_place": allclose(summed, reduced(ctx, N, "sum"), dtype)}
    return case


for _dt in DTYPES:
    suite.add(f"collectives_in_pieces_{_dt}", _in_pieces(_dt))


@suite.case
def strided_input_and_output(ctx: Context) -> dict:
    """Flat tensors that are not contiguous (every other element of a buffer) are read and
    written through a contiguous copy; the elements between them stay as they were."""
    world = ctx.world_size
    source = tensor(np.repeat(rank_values(ctx.rank, world * N), 2), ms.float32)
    out_buffer = tensor(np.full(2 * N, SENTINEL), ms.float32)
    shard = out_buffer[::2]
    ctx.comm.reduce_scatter(shard, source[::2], op="sum")
    expected = reduced(ctx, world * N, "sum")[ctx.rank * N:(ctx.rank + 1) * N]
    summed_buffer = tensor(np.repeat(rank_values(ctx.rank, N), 2), ms.float32)
    ctx.comm.all_reduce(summed_buffer[1::2], op="sum")
    return {"not_contiguous": equal([shard.is_contiguous(), source[::2].is_contiguous()],
                                    [False, False]),
            "shard": allclose(out_buffer[::2], expected, ms.float32),
            "between_untouched": allclose(out_buffer[1::2], np.full(N, SENTINEL), ms.float32),
            "all_reduce_in_place": allclose(summed_buffer[1::2], reduced(ctx, N, "sum"),
                                            ms.float32),
            "all_reduce_others_untouched": allclose(summed_buffer[::2], rank_values(ctx.rank, N),
                                                    ms.float32)}


def _bfloat16_bits(rank: int) -> np.ndarray:
    """Rank 0 sends 1.0 where the others send 2**-8 or 3 * 2**-9 (sums no bfloat16 holds: a tie
    to even and a round up), a negative NaN with payload where the others send 1.0, and every
    rank infinity, the largest bfloat16 (its sum overflows) and zero."""
    first = [0x3F80, 0x3F80, 0xFFC1] if rank == 0 else [0x3B80, 0x3BC0, 0x3F80]
    return np.array(first + [0x7F80, 0x7F7F, 0x0000], np.uint16)


def _as_bfloat16(bits: np.ndarray) -> ms.Tensor:
    return ms.Tensor(bits.view(np.int16)).view(ms.bfloat16)


def _cast_bits(values: np.ndarray) -> list:
    """The bits MindSpore's cast writes for float32 ``values`` into bfloat16."""
    cast = ms.Tensor(values.astype(np.float32)).astype(ms.bfloat16)
    return writable_view(cast).asnumpy().view(np.uint16).tolist()


@suite.case
def bfloat16_results_have_the_bits_of_mindspores_cast(ctx: Context) -> dict:
    """bfloat16 travels as float32: its sums are rounded back as MindSpore's cast rounds (to
    nearest even, overflow to infinity) and a NaN comes back as the NaN that cast writes, for an
    all-reduce, a reduce-scatter and an all-gather alike."""
    world = ctx.world_size
    sent = [_bfloat16_bits(r) for r in range(world)]
    floats = [(bits.astype(np.uint32) << 16).view(np.float32) for bits in sent]
    with np.errstate(invalid="ignore", over="ignore"):
        total = np.sum(floats, axis=0, dtype=np.float32)
    mine = sent[ctx.rank]
    summed = _as_bfloat16(mine.copy())
    ctx.comm.all_reduce(summed, op="sum")
    shard = mint.zeros(mine.size, dtype=ms.bfloat16)
    ctx.comm.reduce_scatter(shard, _as_bfloat16(np.tile(mine, world)), op="sum")
    gathered = mint.zeros(world * mine.size, dtype=ms.bfloat16)
    ctx.comm.all_gather(gathered, _as_bfloat16(mine))

    def raw(t):
        return writable_view(t).asnumpy().view(np.uint16).tolist()
    return {"all_reduce_bits": equal(raw(summed), _cast_bits(total)),
            "reduce_scatter_bits": equal(raw(shard), _cast_bits(total)),
            "all_gather_bits": equal(raw(gathered), _cast_bits(np.concatenate(floats))),
            # at 2 ranks: a tie to even (down), a round up, and the canonical NaN
            "data_rounds_and_has_a_nan": equal(_cast_bits(total)[:3] if world == 2 else None,
                                               [0x3F80, 0x3F81, 0x7FC0] if world == 2 else None)}


# -- argument checks (local: no rank enters a collective) --------------------------------------
@suite.case
def wrong_output_size_raises(ctx: Context) -> dict:
    world = ctx.world_size
    inp = mint.zeros(world * N, dtype=ms.float32)
    return {
        "reduce_scatter": raises(CommError, lambda: ctx.comm.reduce_scatter(
            mint.zeros(N + 1, dtype=ms.float32), inp), str(N + 1), f"expected {N}"),
        "all_gather": raises(CommError, lambda: ctx.comm.all_gather(
            mint.zeros(N, dtype=ms.float32), mint.zeros(N, dtype=ms.float32)),
            f"expected {world * N}"),
        "input_not_multiple_of_world": raises(CommError, lambda: ctx.comm.reduce_scatter(
            mint.zeros(N, dtype=ms.float32), mint.zeros(world * N + 1, dtype=ms.float32)),
            "multiple"),
    }


@suite.case
def wrong_output_dtype_raises(ctx: Context) -> dict:
    inp = mint.zeros(ctx.world_size * N, dtype=ms.float32)
    return {"reduce_scatter": raises(CommError, lambda: ctx.comm.reduce_scatter(
        mint.zeros(N, dtype=ms.float16), inp), "Float16", "Float32")}


# -- handles and backend choice ----------------------------------------------------------------
@suite.case
def communicator_for_picks_mccl(ctx: Context) -> dict:
    comm = communicator_for()
    return {"type": equal(type(comm).__name__, CpuMcclCommunicator.__name__),
            "world_size": equal(comm.world_size, 2),
            "rank_matches_env": equal(comm.rank, ctx.rank)}


@suite.case
def async_op_returns_completed_handle(ctx: Context) -> dict:
    t = tensor(rank_values(ctx.rank, N), ms.float32)
    handle = ctx.comm.all_reduce(t, async_op=True)
    return {"type": equal(type(handle).__name__, CompletedHandle.__name__),
            "completed": equal(handle.is_completed(), True),
            "written": allclose(t, reduced(ctx, N, "sum"), ms.float32)}


@suite.case
def fault_injection_over_mccl(ctx: Context) -> dict:
    faulty = FaultInjectingCommunicator(ctx.comm, delay_seconds=0.3, fail_wait=True)
    t = tensor(rank_values(ctx.rank, N), ms.float32)
    handle = faulty.all_reduce(t)
    before = handle.is_completed()
    written_before_wait = allclose(t, reduced(ctx, N, "sum"), ms.float32)
    wait = raises(CommError, handle.wait, "injected failure")
    return {"not_completed_before_delay": equal(before, False),
            "result_written_before_wait": written_before_wait,
            "wait_raises": wait,
            "completed_after_wait": equal(handle.is_completed(), True),
            "launches": equal(faulty.launches, 1)}



# -- gradpool.exchange: small host values between the ranks ------------------------------------
def _ints_of(rank: int) -> list[int]:
    """Values a limb bug shows: signs, above 2**24 and 2**48, the int64 extremes; per rank."""
    big = 2 ** 62
    return [-(rank + 1), 2 ** 24 + 1 + rank, 2 ** 48 + 3 + rank, -(2 ** 48) - rank,
            big - 7 * rank, -big + rank, 2 ** 63 - 1 - rank, -(2 ** 63) + rank, 0]


@suite.case
def exchange_ints_exactly(ctx: Context) -> dict:
    from gradpool import all_sum_ints, exchange_ints
    world = ctx.world_size
    every = np.array([_ints_of(r) for r in range(world)], np.int64)
    got = exchange_ints(ctx.comm, _ints_of(ctx.rank))
    ids = [2 ** 64 - 1 - ctx.rank, 2 ** 63 + ctx.rank]
    unsigned = exchange_ints(ctx.comm, ids, unsigned=True)
    summed = [2 ** 50 + ctx.rank, -(2 ** 40) - 3 * ctx.rank, 2 ** 24 + 1]
    return {"rows": equal(got.tolist(), every.tolist()),
            "dtype": equal(str(got.dtype), "int64"),
            "unsigned": equal([[int(v) for v in row] for row in unsigned],
                              [[2 ** 64 - 1 - r, 2 ** 63 + r] for r in range(world)]),
            "sum": equal(all_sum_ints(ctx.comm, summed).tolist(),
                         [sum(2 ** 50 + r for r in range(world)),
                          sum(-(2 ** 40) - 3 * r for r in range(world)), world * (2 ** 24 + 1)])}


@suite.case
def exchange_values_and_all_sum(ctx: Context) -> dict:
    from gradpool import all_sum, exchange_values
    world = ctx.world_size
    floats = lambda r: [0.1 * (r + 1), -1e30 * (r + 1), 2.0 ** -20 * r]     # noqa: E731
    got = exchange_values(ctx.comm, ints=[2 ** 40 + ctx.rank], floats=floats(ctx.rank))
    block = rank_values(ctx.rank, 15).reshape(3, 5)
    total = all_sum(ctx.comm, block)
    return {"ints": equal(got.ints.tolist(), [[2 ** 40 + r] for r in range(world)]),
            "floats": equal(got.floats.tolist(),
                            np.array([floats(r) for r in range(world)], np.float32).tolist()),
            "all_sum_shape": equal(list(total.shape), [3, 5]),
            "all_sum": allclose(total, sum(rank_values(r, 15) for r in range(world))
                                .reshape(3, 5), ms.float32)}


@suite.case
def rank_rows_cross_exactly(ctx: Context) -> dict:
    """gradpool train's per-rank rows (its outcome: ints past 2**24 and floats) over the wire."""
    from gradpool.app.rank_main import OUTCOME_FIELDS, exchange
    rows = [[1, 5, 205 - r, r, 43, 2 ** 40 + 3 + r, 7, 2 ** 33 + 1, 2 ** 45 + 12345 * r,
             0.25 * r, 0.5, 2, 2 ** 48 - 1 - r] for r in range(ctx.world_size)]
    return {"rows": equal(exchange(ctx.comm, rows[ctx.rank], OUTCOME_FIELDS), rows)}



@suite.case
def state_held_by_some_ranks_is_shared(ctx: Context) -> dict:
    """hyper_parallel's state of some ranks only (experts under EP), over the exchange: rank r
    holds ``common`` and ``own.r`` (distinct name lists, so digests differ and the lists travel);
    every rank learns who holds what and gets every tensor from its holder, values intact."""
    from hyper_parallel.core.fully_shard.held_by_some import share_full_tensors, world_keys
    world = ctx.world_size

    def values(rank: int, shape) -> np.ndarray:
        return rank_values(rank, int(np.prod(shape)), seed=7).reshape(shape)
    shapes = {r: (3, 5 + r) for r in range(world)}
    local = {"common": ms.Tensor(values(0, (4,)).astype(np.float32)),
             f"own.{ctx.rank}": ms.Tensor(values(ctx.rank, shapes[ctx.rank]).astype(np.float32))}
    keys = world_keys({name: (tuple(t.shape), "float32") for name, t in local.items()},
                      ctx.comm)
    full = share_full_tensors(local, ctx.comm)
    return {"holders": equal({name: list(key.holders) for name, key in sorted(keys.items())},
                             {"common": list(range(world)),
                              **{f"own.{r}": [r] for r in range(world)}}),
            "names": equal(sorted(full), sorted(["common"] + [f"own.{r}" for r in range(world)])),
            **{f"own.{r}": allclose(full.get(f"own.{r}", np.zeros(0)), values(r, shapes[r]),
                                    ms.float32)
               for r in range(world)}}


if __name__ == "__main__":
    suite.main()
