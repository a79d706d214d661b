"""GradReducer cases, run on every rank of one msrun launch (tests/test_reducer_distributed.py)
and, one case per test, in-process with world size 1 (tests/test_reducer.py).

Usage: ``python -m gradpool.launch --nproc 2 tests/distributed/reducer_cases.py OUT_DIR [CASE ...]``.

Every case is world-size agnostic: each rank builds every rank's gradients from a seed, so it
computes the NumPy reference of the whole reduction itself (rank r's shard is chunk r of the shard
dim padded up to a multiple of W, padding 0). Gradient values are random standard-normal float32,
not exact in float16 or bfloat16, so a pack that rounds, truncates or drops a value shows. The
reference rounds exactly as the reduce path must (:mod:`npref`): each gradient cast to its dtype
and then to the reduce dtype (nearest even), micro-steps added in float32 and rounded once into the
bucket, ranks summed in the wire dtype (float32 for bfloat16) and, for ``avg``, divided by W there,
then rounded to the reduce dtype. With two ranks the sum has one order, so every value check is
exact (rtol = atol = 0).

Every case also checks the caller's side of the contract: after ``wait()`` (and after release,
``wait_all`` and ``trim``) each gradient still has its full storage and its original bytes.
"""
from __future__ import annotations

import hashlib
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import mindspore as ms

from gradpool.testing import FaultInjectingCommunicator
from gradpool.errors import CollectiveError
from gradpool.layout import ReduceScatterLayout
from gradpool.dtypes import itemsize
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig
from harness import Context, Suite, allclose, equal, raises

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: npref
from npref import add_rounded, normal, np_chunk, reduce_over_ranks, round_to  # noqa: E402

suite = Suite("reducer")

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
REDUCE_DTYPES = ("float32", "float16", "bfloat16")
GRAD_DTYPES = ("float32", "float16", "bfloat16")
OPS = ("sum", "avg")
# Odd dim 0 (uneven shards for W=2), a 3-D gradient, two Shard(1)-style gradients (one with an odd
# dim 1) and one (8, 4) that splits evenly.
SHAPES = [(7, 3), (5,), (9, 2, 3), (4, 6), (3, 5), (8, 4)]
SHARD_DIMS = [0, 0, 0, 1, 1, 0]
# Bytes per fused bucket for the "several buckets" mode: 4 buckets in float32, 2 in 16-bit dtypes.
SMALL_CAP_BYTES = 200
SMALL_CAP_MIB = SMALL_CAP_BYTES / 2 ** 20
MODES = ("pergrad", "fused", "fused_small_cap")
# Pack with NumPy through host memory where it applies (CPU); tests set False for the device path.
HOST_COPIES = True
DELAY = 0.5     # seconds a FaultInjectingCommunicator handle stays "in flight" (a wide margin
                # over the few ms of local work the fence checks below rely on)
# The fence cases use collectives that read their input at wait(), like a real asynchronous one:
# an input bucket handed out again before its collective ran would be reduced with the wrong data.
LATE = "wait"


# -- data and references ---------------------------------------------------------------------------
def grad_values(rank: int, shapes, seed: int) -> list[np.ndarray]:
    """Rank ``rank``'s gradient values of micro-step ``seed`` (float32, standard normal)."""
    rng = np.random.default_rng(10_000 * seed + rank)
    return [normal(rng, shape) for shape in shapes]


def to_tensor(values: np.ndarray, dtype) -> ms.Tensor:
    return ms.Tensor(values.astype(np.float32)).astype(dtype)


def make_grads(ctx: Context, shapes, dtypes, seed: int) -> list[ms.Tensor]:
    """This rank's gradients; ``dtypes`` is one dtype for all or one per gradient."""
    if not isinstance(dtypes, (list, tuple)):
        dtypes = [dtypes] * len(shapes)
    return [to_tensor(v, d) for v, d in zip(grad_values(ctx.rank, shapes, seed), dtypes)]


def _each(value, count: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * count


def reduced(ctx: Context, shapes, op: str, seeds, grad_dtypes=ms.float32,
            reduce_dtype=None) -> list[np.ndarray]:
    """The reduction over ranks of the gradients of every seed in ``seeds``: the first seed is
    packed, the others accumulated (micro-steps), each rounded as the reduce path rounds.
    ``reduce_dtype`` None: each gradient in its own dtype (a list: one per gradient). float32
    values of the reduce dtype."""
    grad_dtypes = _each(grad_dtypes, len(shapes))
    reduce_dtypes = [r or g for r, g in zip(_each(reduce_dtype, len(shapes)), grad_dtypes)]
    per_rank = []
    for rank in range(ctx.world_size):
        bucket = None
        for seed in seeds:
            step = [round_to(v, g) for v, g in zip(grad_values(rank, shapes, seed), grad_dtypes)]
            if bucket is None:
                bucket = [round_to(v, r) for v, r in zip(step, reduce_dtypes)]
            else:
                bucket = [add_rounded(b, v, r) for b, v, r in zip(bucket, step, reduce_dtypes)]
        per_rank.append(bucket)
    return [reduce_over_ranks([bucket[i] for bucket in per_rank], reduce_dtypes[i], op,
                              ctx.world_size) for i in range(len(shapes))]


def expected_shard(full: np.ndarray, dim: int, rank: int, world: int) -> np.ndarray:
    """Rank ``rank``'s chunk of ``full`` along ``dim``, padded with zeros to ceil(d / W)."""
    return np_chunk(full, dim, rank, world)


def exact(actual, expected, dtype) -> dict:
    """``actual`` holds exactly the values ``expected`` (float32 values of ``dtype``)."""
    return allclose(actual, expected, dtype, rtol=0, atol=0)


def data_checks(ctx: Context, shapes, seeds) -> dict:
    """The test data are not exact in bfloat16 or float16: a pack truncating float32 to bfloat16
    precision, or rounding through float16, changes them (so the exact checks can see it)."""
    values = np.concatenate([v.reshape(-1) for seed in seeds
                             for v in grad_values(ctx.rank, shapes, seed)])
    return {"data_not_exact_in_bfloat16": equal(bool(np.any(round_to(values, "bfloat16") != values)), True),
            "data_not_exact_in_float16": equal(bool(np.any(round_to(values, "float16") != values)), True)}


def fingerprint(tensor: ms.Tensor) -> list:
    """(storage bytes, sha256 of the tensor's bytes): what a caller's gradient must keep."""
    raw = tensor.view(ms.int16) if tensor.dtype == ms.bfloat16 else tensor
    return [tensor.untyped_storage().size(), hashlib.sha256(raw.asnumpy().tobytes()).hexdigest()]


def storage_ptr(tensor: ms.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def has_nan(tensors) -> bool:
    return any(bool(np.isnan(t.astype(ms.float32).asnumpy()).any()) for t in tensors)


# -- shared checks -----------------------------------------------------------------------------------
def shard_checks(ctx: Context, shards, shapes, dims, op: str, seeds, dtypes, prefix="",
                 grad_dtypes=ms.float32) -> dict:
    """Each shard exactly equal to the NumPy reference (``dtypes``: the reduce dtype of each
    shard), plus each shard's dtype."""
    dtypes = _each(dtypes, len(shapes))
    checks = {f"{prefix}count": equal(len(shards), len(shapes))}
    fulls = reduced(ctx, shapes, op, seeds, grad_dtypes, dtypes)
    for i, (full, dim, dtype) in enumerate(zip(fulls, dims, dtypes)):
        expected = expected_shard(full, dim, ctx.rank, ctx.world_size)
        checks[f"{prefix}shard{i}_{shapes[i]}_dim{dim}"] = exact(shards[i], expected, dtype)
        checks[f"{prefix}shard{i}_dtype"] = equal(str(shards[i].dtype), str(dtype))
    return checks


def full_checks(ctx: Context, outputs, shapes, op: str, seeds, dtype, prefix="",
                grad_dtypes=ms.float32) -> dict:
    """All-reduce results: whole gradients reduced over ranks, exactly."""
    checks = {f"{prefix}count": equal(len(outputs), len(shapes))}
    for i, full in enumerate(reduced(ctx, shapes, op, seeds, grad_dtypes, dtype)):
        checks[f"{prefix}grad{i}_{shapes[i]}"] = exact(outputs[i], full, dtype)
        checks[f"{prefix}grad{i}_dtype"] = equal(str(outputs[i].dtype), str(dtype))
    return checks


def intact_checks(grads, before, when: str) -> dict:
    return {f"grad{i}_storage_and_bytes_{when}": equal(fingerprint(g), fp)
            for i, (g, fp) in enumerate(zip(grads, before))}


def grouping_checks(buckets, grads, cap_bytes: float, reduce_dtype, expect_several: bool) -> dict:
    """Fused buckets hold consecutive gradients, in order, each bucket within the cap unless it is
    a single gradient, and greedy: the next bucket's first gradient would not have fit."""
    def nbytes(i):
        return grads[i].numel() * itemsize(reduce_dtype or grads[i].dtype)

    groups = [list(b.indices) for b in buckets]
    sizes = [sum(nbytes(i) for i in g) for g in groups]
    within = all(size <= cap_bytes or len(g) == 1 for g, size in zip(groups, sizes))
    greedy = all(size + nbytes(nxt[0]) > cap_bytes
                 for size, nxt in zip(sizes, groups[1:]))
    checks = {"buckets_in_order": equal(sum(groups, []), list(range(len(grads)))),
              "buckets_within_cap": equal(within, True),
              "buckets_greedy": equal(greedy, True)}
    if expect_several:
        checks["several_buckets"] = equal(1 < len(groups) < len(grads), True)
    else:
        checks["one_bucket"] = equal(len(groups), 1)
    return checks


def reducer_config(host=None, **fields) -> ReducerConfig:
    """``host`` None: the module's HOST_COPIES (tests flip it); True/False: that write path."""
    return ReducerConfig(host_copies=HOST_COPIES if host is None else host, **fields)


def config_for(mode: str, reduce_dtype, zero_copy: bool = False, host=None) -> ReducerConfig:
    return reducer_config(host=host, reduce_dtype=reduce_dtype, comm_fusion=mode != "pergrad",
                          bucket_cap_mib=SMALL_CAP_MIB if mode == "fused_small_cap" else 25.0,
                          zero_copy=zero_copy)


def path_suffix(host) -> str:
    return "" if host is None else ("_host" if host else "_device")


def release_checks(pool: BucketPool, result, grads, before) -> dict:
    """The gradients are intact after ``result.wait()``, and after its release and a trim."""
    checks = intact_checks(grads, before, "after_wait")
    result.release()
    checks.update(after_release_checks(pool, grads, before))
    return checks


def after_release_checks(pool: BucketPool, grads, before) -> dict:
    """Release leaves no lease; wait_all + trim (which frees pool storage) never touch a grad."""
    stats = pool.stats()
    pool.wait_all()
    pool.trim()
    checks = {"no_live_leases_after_release": equal(stats.live_leases, 0)}
    checks.update(intact_checks(grads, before, "after_release_and_trim"))
    return checks


def _poisoned_reducer(ctx: Context, config: ReducerConfig, grad_dtypes, seed: int):
    """A pool that poisons what it recycles, a reducer on it over the world, gradients of
    ``SHAPES`` and their fingerprints."""
    pool = BucketPool(poison_on_release=True)
    grads = make_grads(ctx, SHAPES, grad_dtypes, seed=seed)
    return pool, GradReducer(pool, ctx.comm, config), grads, [fingerprint(g) for g in grads]


# -- reduce-scatter against NumPy: op x reduce dtype x grad dtype x bucketing -------------------------
def _reduce_scatter(op: str, reduce_name: str, grad_name: str, mode: str, host=None):
    def case(ctx: Context) -> dict:
        reduce_dtype, grad_dtype = DTYPES[reduce_name], DTYPES[grad_name]
        pool, reducer, grads, before = _poisoned_reducer(
            ctx, config_for(mode, reduce_dtype, host=host), grad_dtype, 1)
        buckets = reducer.pack(grads, SHARD_DIMS)
        checks = {}
        if mode == "pergrad":
            checks["one_bucket_per_grad"] = equal(len(buckets), len(grads))
        else:
            cap = SMALL_CAP_BYTES if mode == "fused_small_cap" else 25 * 2 ** 20
            checks.update(grouping_checks(buckets, grads, cap, reduce_dtype,
                                          expect_several=mode == "fused_small_cap"))
        result = reducer.launch(buckets, op=op)
        shards = result.wait()
        checks.update(data_checks(ctx, SHAPES, [1]))
        checks.update(shard_checks(ctx, shards, SHAPES, SHARD_DIMS, op, [1], reduce_dtype,
                                   grad_dtypes=grad_dtype))
        checks["live_leases_while_shards_held"] = equal(pool.stats().live_leases, len(buckets))
        checks.update(release_checks(pool, result, grads, before))
        return checks
    return case


for _op in OPS:
    for _rd in REDUCE_DTYPES:
        for _gd in GRAD_DTYPES:
            for _mode in MODES:
                suite.add(f"reduce_scatter_{_op}_reduce_{_rd}_grad_{_gd}_{_mode}",
                          _reduce_scatter(_op, _rd, _gd, _mode))
# The device (Ascend-portable) write path on CPU too, for every dtype pair.
for _rd in REDUCE_DTYPES:
    for _gd in GRAD_DTYPES:
        suite.add(f"reduce_scatter_avg_reduce_{_rd}_grad_{_gd}_pergrad_device",
                  _reduce_scatter("avg", _rd, _gd, "pergrad", host=False))


def _reduce_scatter_mixed_grads(reduce_name, mode: str):
    """float32 and bfloat16 gradients in one call; reduce_dtype None keeps each grad's dtype."""
    def case(ctx: Context) -> dict:
        reduce_dtype = DTYPES[reduce_name] if reduce_name else None
        grad_dtypes = [ms.float32, ms.bfloat16] * (len(SHAPES) // 2)
        pool, reducer, grads, before = _poisoned_reducer(ctx, config_for(mode, reduce_dtype),
                                                         grad_dtypes, 2)
        result = reducer.reduce_scatter(grads, SHARD_DIMS, op="avg")
        shards = result.wait()
        expected_dtypes = [reduce_dtype] * len(SHAPES) if reduce_dtype else grad_dtypes
        checks = shard_checks(ctx, shards, SHAPES, SHARD_DIMS, "avg", [2], expected_dtypes,
                              grad_dtypes=grad_dtypes)
        if mode == "fused":   # one bucket per reduce dtype
            checks["fused_buckets"] = equal(len(result.launched), 1 if reduce_dtype else 2)
        checks.update(release_checks(pool, result, grads, before))
        return checks
    return case


for _rd in ("float32", None):
    for _mode in ("pergrad", "fused"):
        suite.add(f"reduce_scatter_mixed_grad_dtypes_reduce_{_rd or 'own'}_{_mode}",
                  _reduce_scatter_mixed_grads(_rd, _mode))


# -- all_reduce (replicated gradients) --------------------------------------------------------------
def _all_reduce(op: str, reduce_name: str, grad_name: str, mode: str, host=None):
    def case(ctx: Context) -> dict:
        reduce_dtype, grad_dtype = DTYPES[reduce_name], DTYPES[grad_name]
        pool, reducer, grads, before = _poisoned_reducer(
            ctx, config_for(mode, reduce_dtype, host=host), grad_dtype, 3)
        result = reducer.all_reduce(grads, op=op)
        outputs = result.wait()
        checks = full_checks(ctx, outputs, SHAPES, op, [3], reduce_dtype, grad_dtypes=grad_dtype)
        checks.update(release_checks(pool, result, grads, before))
        return checks
    return case


for _op in OPS:
    for _rd in REDUCE_DTYPES:
        for _mode in ("pergrad", "fused"):
            suite.add(f"all_reduce_{_op}_reduce_{_rd}_grad_float32_{_mode}",
                      _all_reduce(_op, _rd, "float32", _mode))
    suite.add(f"all_reduce_{_op}_reduce_float32_grad_bfloat16_fused",
              _all_reduce(_op, "float32", "bfloat16", "fused"))
    suite.add(f"all_reduce_{_op}_reduce_float16_grad_float16_fused",
              _all_reduce(_op, "float16", "float16", "fused"))
for _rd in REDUCE_DTYPES:
    suite.add(f"all_reduce_avg_reduce_{_rd}_grad_float32_fused_device",
              _all_reduce("avg", _rd, "float32", "fused", host=False))


# -- gradient accumulation: pack micro-step 1, accumulate micro-steps 2 and 3, launch ---------------
ACC_SEEDS = (4, 5, 14)


def _accumulate(op: str, reduce_name: str, grad_name: str, mode: str, all_reduce: bool = False,
                host=None):
    def case(ctx: Context) -> dict:
        reduce_dtype, grad_dtype = DTYPES[reduce_name], DTYPES[grad_name]
        pool = BucketPool(poison_on_release=True)
        reducer = GradReducer(pool, ctx.comm, config_for(mode, reduce_dtype, host=host))
        steps = [make_grads(ctx, SHAPES, grad_dtype, seed=seed) for seed in ACC_SEEDS]
        every = [g for step in steps for g in step]
        before = [fingerprint(g) for g in every]
        if all_reduce:
            buckets = reducer.pack(steps[0], world_size=1, allow_borrow=False)
        else:
            buckets = reducer.pack(steps[0], SHARD_DIMS, allow_borrow=False)
        for step in steps[1:]:
            reducer.accumulate(buckets, step)
        result = reducer.launch(buckets, op=op, all_reduce=all_reduce)
        outputs = result.wait()
        if all_reduce:
            checks = full_checks(ctx, outputs, SHAPES, op, ACC_SEEDS, reduce_dtype,
                                 grad_dtypes=grad_dtype)
        else:
            checks = shard_checks(ctx, outputs, SHAPES, SHARD_DIMS, op, ACC_SEEDS, reduce_dtype,
                                  grad_dtypes=grad_dtype)
        checks.update(data_checks(ctx, SHAPES, ACC_SEEDS))
        checks.update(release_checks(pool, result, every, before))
        return checks
    return case


# Every micro-step dtype into every bucket dtype, on both write paths (host: NumPy where it
# applies, i.e. dim-0 float32/float16 buckets; device: forced), per gradient (so the dim-0
# gradients of a host run really take the host path) and fused in several buckets.
for _gd in GRAD_DTYPES:
    for _rd in REDUCE_DTYPES:
        for _host in (True, False):
            for _mode in ("pergrad", "fused_small_cap"):
                suite.add(f"accumulate_avg_reduce_{_rd}_grad_{_gd}_{_mode}{path_suffix(_host)}",
                          _accumulate("avg", _rd, _gd, _mode, host=_host))
for _op in OPS:
    suite.add(f"accumulate_{_op}_reduce_float32_grad_float32_fused_small_cap",
              _accumulate(_op, "float32", "float32", "fused_small_cap"))
    suite.add(f"accumulate_all_reduce_{_op}_reduce_float32_grad_float32_fused",
              _accumulate(_op, "float32", "float32", "fused", all_reduce=True))
suite.add("accumulate_all_reduce_avg_reduce_bfloat16_grad_float16_fused",
          _accumulate("avg", "bfloat16", "float16", "fused", all_reduce=True))


# -- zero-copy ---------------------------------------------------------------------------------------
IDENTITY_SHAPE = (8, 4)
ZC_ALIGN_BYTES = 64      # 16 float32 elements: an (8, 4) float32 chunk fills whole rows for W<=2


def _is_identity(pool: BucketPool, shape, world: int, dtype) -> bool:
    return ReduceScatterLayout.build([shape], world, pool.alignment_elements(dtype)).is_identity()


def _bucket_bytes(pool: BucketPool, shape, dim: int, world: int, dtype) -> int:
    """What packing this gradient alone copies into the pool: its whole input bucket."""
    layout = ReduceScatterLayout.build([shape], world, pool.alignment_elements(dtype), [dim])
    return layout.total_numel * itemsize(dtype)


@suite.case
def zero_copy_borrows_identity_layout(ctx: Context) -> dict:
    """(8, 4) float32 reduced in float32, alignment met: the collective reads the gradient in place
    (no bytes copied, only the output bucket allocated); then (7, 3) in the same call cannot be
    borrowed and is copied, and exactly its bucket's bytes are counted."""
    pool = BucketPool(alignment_bytes=ZC_ALIGN_BYTES, poison_on_release=True)
    reducer = GradReducer(pool, ctx.comm, reducer_config(reduce_dtype=ms.float32, zero_copy=True))
    shapes, dims = [IDENTITY_SHAPE, (7, 3)], [0, 0]
    precondition = _is_identity(pool, IDENTITY_SHAPE, ctx.world_size, ms.float32)
    grads = make_grads(ctx, shapes, ms.float32, seed=6)
    before = [fingerprint(g) for g in grads]
    start = pool.stats()
    borrowed = reducer.launch(reducer.pack(grads[:1], dims[:1]), op="sum")
    after_borrow = pool.stats()
    copied = reducer.launch(reducer.pack(grads[1:], dims[1:]), op="sum")
    after_copy = pool.stats()
    shards = borrowed.wait() + copied.wait()
    checks = {
        "identity_layout_precondition": equal(precondition, True),
        "borrow_copied_no_bytes": equal(after_borrow.bytes_copied - start.bytes_copied, 0),
        "borrow_allocated_output_only": equal(
            after_borrow.new_allocations - start.new_allocations, 1),
        "non_identity_copied_its_bucket": equal(
            after_copy.bytes_copied - after_borrow.bytes_copied,
            _bucket_bytes(pool, (7, 3), 0, ctx.world_size, ms.float32)),
        "borrow_dropped_after_wait": equal(
            [b.bucket.borrowed is None for b in borrowed.launched], [True]),
    }
    checks.update(shard_checks(ctx, shards, shapes, dims, "sum", [6], ms.float32))
    checks.update(intact_checks(grads, before, "after_wait"))
    borrowed.release()
    copied.release()
    checks.update(after_release_checks(pool, grads, before))
    return checks


def _zero_copy_must_copy(why: str, shape, grad_dtype, reduce_dtype, align_bytes: int,
                         fusion: bool = False, count: int = 1):
    def case(ctx: Context) -> dict:
        pool = BucketPool(alignment_bytes=align_bytes, poison_on_release=True)
        reducer = GradReducer(pool, ctx.comm, reducer_config(
            reduce_dtype=reduce_dtype, zero_copy=True, comm_fusion=fusion))
        shapes, dims = [shape] * count, [0] * count
        grads = make_grads(ctx, shapes, grad_dtype, seed=7)
        before = [fingerprint(g) for g in grads]
        start = pool.stats()
        result = reducer.reduce_scatter(grads, dims, op="avg")
        copied = pool.stats().bytes_copied - start.bytes_copied
        layout = ReduceScatterLayout.build(shapes, ctx.world_size,
                                           pool.alignment_elements(reduce_dtype), dims)
        checks = {"copied_whole_bucket": equal(copied, layout.total_numel * itemsize(reduce_dtype)),
                  "copied_nonzero": equal(copied > 0, True),
                  "no_borrow": equal([b.bucket.borrowed is None and b.bucket.lease is not None
                                      for b in result.launched], [True] * len(result.launched))}
        checks.update(shard_checks(ctx, result.wait(), shapes, dims, "avg", [7], reduce_dtype))
        checks.update(release_checks(pool, result, grads, before))
        return checks
    case.__doc__ = f"zero_copy=True still copies when {why}"
    return case


def _zero_copy_every_shape(op: str, mode: str):
    """zero_copy=True over the standard gradients: per gradient only (8, 4) is borrowed and every
    other gradient's bucket is copied; fused buckets are always copied. Results match NumPy."""
    def case(ctx: Context) -> dict:
        pool = BucketPool(alignment_bytes=ZC_ALIGN_BYTES, poison_on_release=True)
        reducer = GradReducer(pool, ctx.comm, config_for(mode, ms.float32, zero_copy=True))
        grads = make_grads(ctx, SHAPES, ms.float32, seed=13)
        before = [fingerprint(g) for g in grads]
        start = pool.stats().bytes_copied
        result = reducer.reduce_scatter(grads, SHARD_DIMS, op=op)
        copied = pool.stats().bytes_copied - start
        if mode == "pergrad":
            borrowable = [_is_identity(pool, shape, ctx.world_size, ms.float32) and dim == 0
                          for shape, dim in zip(SHAPES, SHARD_DIMS)]
            expected = sum(_bucket_bytes(pool, shape, dim, ctx.world_size, ms.float32)
                           for shape, dim, b in zip(SHAPES, SHARD_DIMS, borrowable) if not b)
            checks = {"only_identity_borrowed": equal(
                          [item.bucket.lease is None for item in result.launched], borrowable),
                      "exactly_one_borrowable": equal(sum(borrowable), 1)}
        else:
            layout = ReduceScatterLayout.build(SHAPES, ctx.world_size,
                                               pool.alignment_elements(ms.float32), SHARD_DIMS)
            expected = layout.total_numel * itemsize(ms.float32)
            checks = {"fused_bucket_copied": equal(
                [item.bucket.lease is not None for item in result.launched], [True])}
        checks["bytes_copied"] = equal(copied, expected)
        checks.update(shard_checks(ctx, result.wait(), SHAPES, SHARD_DIMS, op, [13], ms.float32))
        checks.update(release_checks(pool, result, grads, before))
        return checks
    return case


for _op in OPS:
    for _mode in ("pergrad", "fused"):
        suite.add(f"zero_copy_{_op}_all_shapes_{_mode}", _zero_copy_every_shape(_op, _mode))

suite.add("zero_copy_copies_uneven_dim0",
          _zero_copy_must_copy("dim 0 is odd (padding)", (7, 3), ms.float32, ms.float32,
                               ZC_ALIGN_BYTES))
suite.add("zero_copy_copies_when_alignment_pads",
          _zero_copy_must_copy("the chunk is not a multiple of the alignment", IDENTITY_SHAPE,
                               ms.float32, ms.float32, 512))
suite.add("zero_copy_copies_when_reduce_dtype_differs",
          _zero_copy_must_copy("the reduce dtype is not the gradient's", IDENTITY_SHAPE,
                               ms.float32, ms.float16, ZC_ALIGN_BYTES))
suite.add("zero_copy_copies_fused_buckets",
          _zero_copy_must_copy("several gradients share a bucket", IDENTITY_SHAPE, ms.float32,
                               ms.float32, ZC_ALIGN_BYTES, fusion=True, count=2))


# -- fences: a bucket whose collective has not completed is never leased again ----------------------
def _fused_reducer(ctx: Context, pool: BucketPool, comm) -> GradReducer:
    return GradReducer(pool, comm, reducer_config(reduce_dtype=ms.float32, comm_fusion=True))


@dataclass
class _TwoInFlight:
    """Two fused reductions on ``pool``, the second packed while the first's collective is still
    in flight (delayed); what each pack got and what the pool said in between."""

    reducer: GradReducer   # on a communicator whose collectives complete late
    grads: list
    before: list
    inputs: tuple          # the two input buckets' storage
    outputs: tuple         # the two output buckets' storage
    stats: tuple           # pool stats after the first launch, after the second pack
    first_pending: bool    # the first collective had not completed when the second packed
    waited: float          # seconds the second pack took
    results: tuple
    checks: dict           # both results' shards against NumPy


def _two_in_flight(ctx: Context, pool: BucketPool, op: str, seeds: tuple) -> _TwoInFlight:
    faulty = FaultInjectingCommunicator(ctx.comm, delay_seconds=DELAY, read_input_at=LATE)
    reducer = _fused_reducer(ctx, pool, faulty)
    g1, g2 = (make_grads(ctx, SHAPES, ms.float32, seed=seed) for seed in seeds)
    before = [fingerprint(g) for g in g1 + g2]
    b1 = reducer.pack(g1, SHARD_DIMS)
    in1 = storage_ptr(b1[0].lease.tensor)
    r1 = reducer.launch(b1, op=op)
    s1 = pool.stats()
    first_pending = not r1.is_completed()
    start = time.perf_counter()
    b2 = reducer.pack(g2, SHARD_DIMS)
    waited = time.perf_counter() - start
    in2 = storage_ptr(b2[0].lease.tensor)
    s2 = pool.stats()
    r2 = reducer.launch(b2, op=op)
    out1, out2 = (storage_ptr(r.launched[0].output.tensor) for r in (r1, r2))
    shards1, shards2 = r1.wait(), r2.wait()
    # values first: an input bucket re-leased early shows here as the wrong numbers
    checks = shard_checks(ctx, shards1, SHAPES, SHARD_DIMS, op, [seeds[0]], ms.float32, "r1_")
    checks.update(shard_checks(ctx, shards2, SHAPES, SHARD_DIMS, op, [seeds[1]], ms.float32,
                               "r2_"))
    checks["no_nan"] = equal(has_nan(shards1 + shards2), False)
    return _TwoInFlight(reducer, g1 + g2, before, (in1, in2), (out1, out2), (s1, s2), first_pending,
                        waited, (r1, r2), checks)


@suite.case
def in_flight_second_reduce_gets_another_bucket(ctx: Context) -> dict:
    """While the first reduction's collective is in flight (its handle not completed), a second
    one's pack gets a new input bucket, never the fenced one; after completion all recycle."""
    pool = BucketPool(poison_on_release=True)
    run = _two_in_flight(ctx, pool, "sum", (8, 9))
    (in1, in2), (out1, out2), (s1, s2) = run.inputs, run.outputs, run.stats
    checks = {
        **run.checks,
        "first_pending_when_second_packed": equal(run.first_pending, True),
        "first_input_fenced": equal(s2.fenced_buckets, 1),
        "second_input_new_allocation": equal(s2.new_allocations - s1.new_allocations, 1),
        # in2 != in1: the fenced input is not re-leased; out1 is live, so nobody else gets it.
        "second_input_not_first_input": equal(in2 != in1, True),
        "live_output_never_leased": equal(len({in1, in2, out1}) == 3 and out2 != out1, True),
    }
    for result in run.results:
        result.release()
    # Completed fences recycle (poisoned): a third reduce reuses them and is still right.
    s3 = pool.stats()
    r3 = run.reducer.reduce_scatter(run.grads[:len(SHAPES)], SHARD_DIMS, op="sum")
    shards3 = r3.wait()
    s4 = pool.stats()
    checks["recycled_after_completion"] = equal(
        [s3.fenced_buckets, s3.free_buckets, s4.new_allocations - s3.new_allocations],
        [0, s3.new_allocations, 0])
    checks.update(shard_checks(ctx, shards3, SHAPES, SHARD_DIMS, "sum", [8], ms.float32, "r3_"))
    checks.update(release_checks(pool, r3, run.grads, run.before))
    return checks


@suite.case
def in_flight_cap_one_waits_and_counts_stall(ctx: Context) -> dict:
    """max_buckets_in_flight=1: the second pack waits for the first input's fence (a stall), then
    reuses that bucket; the first result's output bucket (still leased) is never handed out."""
    pool = BucketPool(poison_on_release=True, max_buckets_in_flight=1)
    run = _two_in_flight(ctx, pool, "avg", (10, 11))
    (in1, in2), (out1, out2), (s1, s2) = run.inputs, run.outputs, run.stats
    checks = {
        **run.checks,
        "first_pending_before_second_pack": equal(run.first_pending, True),
        "stall_counted": equal(s2.stalls - s1.stalls >= 1, True),
        "stall_seconds_positive": equal(s2.stall_seconds - s1.stall_seconds > 0, True),
        "pack_really_waited": equal(run.waited >= 0.5 * DELAY, True),
        "no_new_input_bucket": equal(s2.new_allocations, s1.new_allocations),
        "input_bucket_reused_after_fence": equal(in2, in1),
        "live_output_never_leased": equal(len({in2, out1, out2}), 3),
    }
    run.results[0].release()
    checks.update(release_checks(pool, run.results[1], run.grads, run.before))
    return checks


@suite.case
def in_flight_per_gradient_buckets_within_one_call(ctx: Context) -> dict:
    """comm_fusion off: one call packs and launches gradient after gradient, so every input
    bucket must stay fenced while the next gradient is packed; the collectives read their inputs
    only at wait(), so an input bucket re-leased early would be reduced with another gradient's
    values (every bucket here has the same capacity: each would be the next one's)."""
    faulty = FaultInjectingCommunicator(ctx.comm, delay_seconds=0.1, read_input_at=LATE)
    pool = BucketPool(poison_on_release=True)
    reducer = GradReducer(pool, faulty, reducer_config(reduce_dtype=ms.float32))
    grads = make_grads(ctx, SHAPES, ms.float32, seed=15)
    before = [fingerprint(g) for g in grads]
    result = reducer.reduce_scatter(grads, SHARD_DIMS, op="avg")
    pending = pool.stats()
    shards = result.wait()
    checks = shard_checks(ctx, shards, SHAPES, SHARD_DIMS, "avg", [15], ms.float32)
    checks.update({"inputs_fenced_until_wait": equal(pending.fenced_buckets, len(SHAPES)),
                   "no_nan": equal(has_nan(shards), False)})
    result.release()
    checks.update(intact_checks(grads, before, "after_wait"))
    checks.update(after_release_checks(pool, grads, before))
    return checks


# -- wait() raising -----------------------------------------------------------------------------------
def _fail_wait(error, all_reduce: bool):
    def case(ctx: Context) -> dict:
        faulty = FaultInjectingCommunicator(ctx.comm, delay_seconds=0.05, fail_wait=error,
                                            read_input_at=LATE)
        pool = BucketPool(poison_on_release=True)
        # per gradient: several collectives in one result, the first one's wait raises
        reducer = GradReducer(pool, faulty, reducer_config(reduce_dtype=ms.float32))
        grads = make_grads(ctx, SHAPES, ms.float32, seed=12)
        before = [fingerprint(g) for g in grads]

        def reduce(op):
            if all_reduce:
                return reducer.all_reduce(grads, op=op)
            return reducer.reduce_scatter(grads, SHARD_DIMS, op=op)

        failing = reduce("sum")
        kind = "all_reduce" if all_reduce else "reduce_scatter"
        expected_text = "injected failure" if error is True else str(error)
        checks = {"wait_raises_typed_naming_the_collective": raises(
            CollectiveError, failing.wait, f"{kind} of 1 gradient(s) [0]", expected_text)}
        after_fail = pool.stats()
        checks["no_live_lease_after_failure"] = equal(after_fail.live_leases, 0)
        failing.release()          # already released by the failed wait(): a no-op
        pool.wait_all()
        # every bucket of a collective that failed is quarantined: all of them fail here
        quarantined = [b for b in pool._buckets if b.state == "quarantined"]
        recycled = pool.stats()
        checks["failed_buckets_quarantined"] = equal(
            [recycled.fenced_buckets, recycled.live_leases, recycled.free_buckets,
             recycled.quarantined_buckets],
            [0, 0, 0, recycled.new_allocations])
        faulty.fail_wait = None    # the fault clears: the same pool and reducer work again
        retry = reduce("avg")
        outputs = retry.wait()
        if all_reduce:
            checks.update(full_checks(ctx, outputs, SHAPES, "avg", [12], ms.float32))
        else:
            checks.update(shard_checks(ctx, outputs, SHAPES, SHARD_DIMS, "avg", [12], ms.float32))
        # The retry never leases a quarantined bucket: all of its buckets are new.
        checks["retry_never_reuses_quarantined_buckets"] = equal(
            [pool.stats().reuses - recycled.reuses,
             all(b.state == "quarantined" and b.lease is None for b in quarantined)], [0, True])
        checks["no_nan"] = equal(has_nan(outputs), False)
        retry.release()
        checks.update(intact_checks(grads, before, "after_failure_and_retry"))
        checks.update(after_release_checks(pool, grads, before))      # trims: frees them
        checks["quarantine_freed_by_trim"] = equal(
            [pool.stats().quarantined_buckets, [b.tensor.untyped_storage().size()
                                                for b in quarantined]], [0, [0] * len(quarantined)])
        return checks
    return case


suite.add("fail_wait_reduce_scatter_comm_error", _fail_wait(True, all_reduce=False))
suite.add("fail_wait_reduce_scatter_custom_exception",
          _fail_wait(RuntimeError("rank link down 4711"), all_reduce=False))
suite.add("fail_wait_all_reduce_comm_error", _fail_wait(True, all_reduce=True))


# fully_shard under the asynchronous launch (its own suite runs blocking, see harness.Suite):
# the fused all-gather and reduce-scatter, and forward prefetch, with ops still queued while
# the pool's buckets are written, recycled and gathered into.
import fsdp_cases  # noqa: E402 - the cases are defined there

FULLY_SHARD_ASYNC = {f"fully_shard_async_{name}": fsdp_cases.suite.cases[name] for name in
                     ("comm_fusion_on", "forward_prefetch_launches_the_next_units_gathers_first")}
for _name, _case in FULLY_SHARD_ASYNC.items():
    suite.add(_name, _case)


if __name__ == "__main__":
    suite.main()
