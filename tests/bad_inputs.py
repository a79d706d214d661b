"""The bad-input matrix: calls across the public surface that must be refused with a typed error
(a subclass of the matching builtin, see gradpool.errors) that names the argument and the value,
before any bucket is leased or any state changes. One table per module; each module's test file
runs its own table through :func:`assert_refused_typed` (test_pool.py, test_layout.py,
test_reducer.py, test_runtime.py, test_fully_shard.py), and test_errors.py holds the whole matrix
to its size."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, mint, nn

from gradpool import (BucketPool, GradPoolConfig, GradPoolError, GradReducer,
                      LayoutMismatchError, ReduceScatterLayout, ReducerConfig,
                      SingleProcessCommunicator, UnsupportedDtypeError)
from hyper_parallel import fully_shard
from hyper_parallel.core.fully_shard.utils import CPUOffloadPolicy, MixedPrecisionPolicy

ms.set_device("CPU")
POOL = BucketPool(alignment_bytes=4)     # shared: every refusal must leave its stats unchanged


def f32(*shape):
    return ms.Tensor(np.ones(shape, np.float32))


def reducer(**config):
    return GradReducer(POOL, SingleProcessCommunicator(), ReducerConfig(**config))


def packed_and_launched():
    red = reducer()
    buckets = red.pack([f32(4)])
    red.launch(buckets).release()
    return red, buckets


# (call, expected error type, a substring the message must hold), one table per module
# gradpool.pool: BucketPool construction, acquire, reserve, release
POOL_CASES = {
    # BucketPool construction
    "pool alignment 0": (lambda: BucketPool(alignment_bytes=0), ValueError, "alignment_bytes"),
    "pool alignment 6": (lambda: BucketPool(alignment_bytes=6), ValueError, "multiple of 4"),
    "pool alignment 2**42": (lambda: BucketPool(alignment_bytes=2 ** 42), ValueError,
                             str(2 ** 42)),
    "pool alignment float": (lambda: BucketPool(alignment_bytes=512.0), TypeError, "512.0"),
    "pool alignment True": (lambda: BucketPool(alignment_bytes=True), TypeError, "True"),
    "pool cap nan": (lambda: BucketPool(max_cached_bytes=math.nan), TypeError, "nan"),
    "pool cap '1k'": (lambda: BucketPool(max_cached_bytes="1k"), TypeError, "'1k'"),
    "pool cap 0": (lambda: BucketPool(max_cached_bytes=0), ValueError, "max_cached_bytes"),
    "pool cap -5": (lambda: BucketPool(max_cached_bytes=-5), ValueError, "-5"),
    "pool in flight 0": (lambda: BucketPool(max_buckets_in_flight=0), ValueError, "max_buckets"),
    "pool in flight 1.5": (lambda: BucketPool(max_buckets_in_flight=1.5), TypeError, "1.5"),
    "pool poison 'yes'": (lambda: BucketPool(poison_on_release="yes"), TypeError, "'yes'"),
    "pool poison 1": (lambda: BucketPool(poison_on_release=1), TypeError, "poison_on_release"),
    "pool device GPU": (lambda: BucketPool(device="GPU"), ValueError, "'GPU'"),
    "pool timed 'no'": (lambda: BucketPool(timed_copies="no"), TypeError, "timed_copies"),
    # acquire / reserve
    "acquire 0": (lambda: POOL.acquire(0, ms.float32), ValueError, "numel"),
    "acquire -1": (lambda: POOL.acquire(-1, ms.float32), ValueError, "-1"),
    "acquire 2.0": (lambda: POOL.acquire(2.0, ms.float32), TypeError, "2.0"),
    "acquire True": (lambda: POOL.acquire(True, ms.float32), TypeError, "True"),
    "acquire numpy int": (lambda: POOL.acquire(np.float64(4), ms.float32), TypeError, "4.0"),
    "acquire int32": (lambda: POOL.acquire(8, ms.int32), UnsupportedDtypeError, "Int32"),
    "acquire bool dtype": (lambda: POOL.acquire(8, ms.bool_), UnsupportedDtypeError, "Bool"),
    "acquire numpy dtype": (lambda: POOL.acquire(8, np.float32), UnsupportedDtypeError, "float32"),
    "acquire 2**62": (lambda: POOL.acquire(2 ** 62, ms.float32), MemoryError, str(2 ** 62)),
    "acquire 2**40": (lambda: POOL.acquire(2 ** 40, ms.float16), MemoryError, str(2 ** 40)),
    "reserve count 0": (lambda: POOL.reserve(ms.float32, 8, count=0), ValueError, "count"),
    "reserve count 1.0": (lambda: POOL.reserve(ms.float32, 8, count=1.0), TypeError, "1.0"),
    "reserve numel '8'": (lambda: POOL.reserve(ms.float32, "8"), TypeError, "'8'"),
    "release a tensor": (lambda: POOL.release(f32(4)), ValueError, "Lease"),
}

# gradpool.layout: ReduceScatterLayout.build
LAYOUT_CASES = {
    "layout world 0": (lambda: ReduceScatterLayout.build([(4,)], 0), ValueError, "world_size"),
    "layout world True": (lambda: ReduceScatterLayout.build([(4,)], True), TypeError, "True"),
    "layout world 2.0": (lambda: ReduceScatterLayout.build([(4,)], 2.0), TypeError, "2.0"),
    "layout float dim": (lambda: ReduceScatterLayout.build([(4, 2)], 2, 1, [1.0]), TypeError,
                         "1.0"),
    "layout float shape": (lambda: ReduceScatterLayout.build([(4.5, 2)], 2), TypeError, "4.5"),
    "layout zero dim": (lambda: ReduceScatterLayout.build([(4, 0)], 2), ValueError, "(4, 0)"),
    "layout 0-d": (lambda: ReduceScatterLayout.build([()], 2), ValueError, "()"),
    "layout dim too big": (lambda: ReduceScatterLayout.build([(4,)], 2, 1, [1]), ValueError,
                           "dim 1"),
    "layout alignment 0": (lambda: ReduceScatterLayout.build([(4,)], 2, 0), ValueError,
                           "alignment"),
    "layout dims count": (lambda: ReduceScatterLayout.build([(4,), (2,)], 2, 1, [0]), ValueError,
                          "shard_dims has 1"),
}

# gradpool.reducer: ReducerConfig and GradReducer calls
REDUCER_CASES = {
    # ReducerConfig
    "reducer fusion 'no'": (lambda: ReducerConfig(comm_fusion="no"), TypeError, "'no'"),
    "reducer zero_copy 'false'": (lambda: ReducerConfig(zero_copy="false"), TypeError, "'false'"),
    "reducer host 0": (lambda: ReducerConfig(host_copies=0), TypeError, "host_copies"),
    "reducer cap 0": (lambda: ReducerConfig(bucket_cap_mib=0), ValueError, "bucket_cap_mib"),
    "reducer cap nan": (lambda: ReducerConfig(bucket_cap_mib=math.nan), ValueError, "nan"),
    "reducer cap '25'": (lambda: ReducerConfig(bucket_cap_mib="25"), TypeError, "'25'"),
    "reducer dtype int32": (lambda: ReducerConfig(reduce_dtype=ms.int32), UnsupportedDtypeError,
                            "Int32"),
    # GradReducer calls
    "reduce int32 grad": (lambda: reducer(reduce_dtype=ms.float32).reduce_scatter(
        [f32(4), ms.Tensor(np.ones(4, np.int32))]), UnsupportedDtypeError, "Int32"),
    "reduce numpy grad": (lambda: reducer().reduce_scatter([np.ones(4, np.float32)]), ValueError,
                          "ndarray"),
    "reduce bad dim late": (lambda: reducer(comm_fusion=False).reduce_scatter(
        [f32(4), f32(3, 2)], [0, 2]), ValueError, "dim 2"),
    "reduce dims count": (lambda: reducer().reduce_scatter([f32(4)], [0, 0]), ValueError,
                          "shard_dims has 2"),
    "reduce op max": (lambda: reducer().reduce_scatter([f32(4)], op="max"), ValueError, "'max'"),
    "all_reduce op mean": (lambda: reducer().all_reduce([f32(4)], op="mean"), ValueError,
                           "'mean'"),
    "accumulate too few": (lambda: _accumulate([f32(4), f32(3)], [f32(4)]), ValueError,
                           "got 1 gradients"),
    "accumulate too many": (lambda: _accumulate([f32(4)], [f32(4), f32(3)]), ValueError,
                            "got 2 gradients"),
    "accumulate shape": (lambda: _accumulate([f32(4), f32(3)], [f32(4), f32(5)]),
                         LayoutMismatchError, "(5,)"),
    "accumulate int32": (lambda: _accumulate([f32(4)], [ms.Tensor(np.ones(4, np.int32))]),
                         UnsupportedDtypeError, "Int32"),
    "relaunch": (lambda: _relaunch(), RuntimeError, "launched or discarded"),
}

# gradpool.runtime: GradPoolConfig
RUNTIME_CASES = {
    "config fusion cap 0": (lambda: GradPoolConfig(bucket_cap_mib=0), ValueError,
                            "bucket_cap_mib"),
    "config cap 1e-12": (lambda: GradPoolConfig(bucket_cap_mib=1e-12), ValueError, "1e-12"),
    "config cached nan": (lambda: GradPoolConfig(max_cached_mib=math.nan), ValueError, "nan"),
    "config cached '1k'": (lambda: GradPoolConfig(max_cached_mib="1k"), TypeError, "'1k'"),
    "config cached tiny": (lambda: GradPoolConfig(max_cached_mib=0.00001), ValueError, "1e-05"),
    "config in flight True": (lambda: GradPoolConfig(max_buckets_in_flight=True), TypeError,
                              "True"),
    "config align 2**42": (lambda: GradPoolConfig(alignment_bytes=2 ** 42), ValueError,
                           "alignment_bytes"),
    "config zero_copy 'false'": (lambda: GradPoolConfig(zero_copy="false"), TypeError,
                                 "'false'"),
    "config poison 1": (lambda: GradPoolConfig(poison_on_release=1), TypeError,
                        "poison_on_release"),
    "config verify None": (lambda: GradPoolConfig(verify_gradients=None), TypeError,
                           "verify_gradients"),
    "config unit order 'no'": (lambda: GradPoolConfig(check_unit_order="no"), TypeError,
                               "check_unit_order"),
}

# hyper_parallel's fully_shard: its policies and keywords
FULLY_SHARD_CASES = {
    # policies
    "mp main_grad 'false'": (lambda: MixedPrecisionPolicy(apply_grad_on_fp32_main_grad="false"),
                             TypeError, "'false'"),
    "mp cast inputs 1": (lambda: MixedPrecisionPolicy(cast_forward_inputs=1), TypeError,
                         "cast_forward_inputs"),
    "mp param int32": (lambda: MixedPrecisionPolicy(param_dtype=ms.int32), ValueError,
                       "mp_policy.param_dtype"),
    "mp reduce 'float32'": (lambda: MixedPrecisionPolicy(reduce_dtype="float32"), ValueError,
                            "mp_policy.reduce_dtype"),
    "mp output bool": (lambda: MixedPrecisionPolicy(output_dtype=ms.bool_), ValueError,
                       "mp_policy.output_dtype"),
    "offload pin 'yes'": (lambda: CPUOffloadPolicy(pin_memory="yes"), TypeError, "pin_memory"),
    # fully_shard keywords
    "fs comm_fusion 'no'": (lambda: fully_shard(Net(), comm_fusion="no"), TypeError, "'no'"),
    "fs reshard 0": (lambda: fully_shard(Net(), reshard_after_forward=0), TypeError,
                     "reshard_after_forward"),
    "fs mp dict": (lambda: fully_shard(Net(), mp_policy={}), ValueError, "mp_policy"),
    "fs pool dict": (lambda: fully_shard(Net(), pool_config={"zero_copy": True}), ValueError,
                     "pool_config"),
    "fs offload cpu": (lambda: fully_shard(Net(), offload_policy=CPUOffloadPolicy()), ValueError,
                       "CPUOffloadPolicy"),
    "fs not a cell": (lambda: fully_shard(object()), ValueError, "object"),
    "fs empty list": (lambda: fully_shard([]), ValueError, "empty list"),
    "fs same twice": (lambda: _twice(), ValueError, "twice"),
}
CASES = {**POOL_CASES, **LAYOUT_CASES, **REDUCER_CASES, **RUNTIME_CASES, **FULLY_SHARD_CASES}


class Net(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = Parameter(ms.Tensor(rng.standard_normal((5, 4)).astype(np.float32)), name="w")
        self.v = Parameter(ms.Tensor(rng.standard_normal((3, 5)).astype(np.float32)), name="v")
        self.s = Parameter(ms.Tensor(np.float32(0.5)), name="s")     # 0-d

    def construct(self, x):
        return mint.matmul(mint.matmul(x, self.w.T), self.v.T) * self.s


def _twice():
    net = Net()
    fully_shard([net, net], replicate_params={net.s})


def _accumulate(packed, micro):
    red = reducer(comm_fusion=True)
    buckets = red.pack(packed, allow_borrow=False)
    before = [b.lease.tensor.asnumpy().copy() for b in buckets]
    try:
        red.accumulate(buckets, micro)
    finally:
        after = [b.lease.tensor.asnumpy().copy() for b in buckets]
        red.discard(buckets)
        assert all(np.array_equal(a, b) for a, b in zip(before, after)), \
            "a refused accumulate changed a bucket"


def _relaunch():
    red, buckets = packed_and_launched()
    red.launch(buckets)


def assert_refused_typed(name):
    """One case of the matrix: refused with its error type, naming the value, nothing leased."""
    call, error, needle = CASES[name]
    before = POOL.stats()
    with pytest.raises(error) as info:
        call()
    assert needle in str(info.value), f"{name}: {info.value}"
    assert isinstance(info.value, GradPoolError), type(info.value)
    after = POOL.stats()
    assert (after.live_leases, after.fenced_buckets) == (0, 0), "nothing left leased"
    if not name.startswith(("accumulate", "relaunch")):    # those pack first, on purpose
        assert after.new_allocations == before.new_allocations, "refused before any allocation"
