"""Benchmark cases shared by the pytest-benchmark suites and the ``python -m benchmarks`` runner.

Each ``make_*`` function does the set-up and returns a zero-argument callable that runs one
measured iteration to completion: a device write is waited for (PyNative launches ops
asynchronously, and an unwaited timing measures only the launch); a NumPy host write is complete
when it returns, so nothing is waited for then.

Every callable also has ``check()``: after timing, one untimed run of the same operation on new,
non-constant data (another seed), compared with a NumPy reference: the bytes a pack wrote must be
exactly the gradients (cast by round to nearest even), the reduced shards must be NumPy's
average. A pack that wrote nothing, or wrote the last step's data, fails ``check()``, so a
benchmark cannot report a fast time for work it did not do (``BenchmarkCheckError``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

KIB = 1024
MIB = 1024 * KIB
COPY_SIZES = (4 * KIB, 64 * KIB, MIB, 16 * MIB, 64 * MIB, 256 * MIB)
DTYPE_PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"),
               ("bfloat16", "float32"), ("float32", "bfloat16"))
METHODS = ("pool", "zero_copy", "fresh_alloc", "memcpy")
SMALL_COUNT, SMALL_NUMEL = 1000, 1024
TIMED_SEED, CHECK_SEED = 7, 8
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
_PERIOD = 65521       # a prime: tiled data whose period no power-of-two offset error can hide


class BenchmarkCheckError(AssertionError):
    """A benchmarked operation did not produce what it claims (checked after timing)."""


class BenchmarkError(RuntimeError):
    """The benchmark could not run (a rank failed, an option is impossible, a check failed)."""


@dataclass(frozen=True)
class CopyCase:
    """Copy-in of gradients of ``grad_dtype`` into a ``bucket_dtype`` buffer."""

    method: str
    grad_dtype: str
    bucket_dtype: str
    nbytes: int            # bytes of gradient data (in the gradient's dtype)
    count: int = 1         # gradients (``count`` of ``nbytes / count`` each)

    @property
    def name(self) -> str:
        what = f"{self.count}x" if self.count > 1 else ""
        return f"{self.method}-{self.grad_dtype}->{self.bucket_dtype}-{what}{_size(self.nbytes)}"

    @property
    def supported(self) -> bool:
        # Zero-copy can only hand the gradient itself to the collective: no cast, one gradient.
        if self.method == "zero_copy":
            return self.grad_dtype == self.bucket_dtype and self.count == 1
        return True

    @property
    def numel(self) -> int:
        """Elements in all gradients together (= in the bucket)."""
        return self.nbytes // _ITEMSIZE[self.grad_dtype]

    @property
    def bucket_nbytes(self) -> int:
        """Bytes the pack writes (the bucket's dtype): what the memcpy reference copies."""
        return self.numel * _ITEMSIZE[self.bucket_dtype]


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def copy_cases(sizes=COPY_SIZES, pairs=DTYPE_PAIRS, methods=METHODS) -> list[CopyCase]:
    cases = [CopyCase(m, g, b, n) for n in sizes for g, b in pairs for m in methods]
    cases += [CopyCase(m, g, b, SMALL_COUNT * SMALL_NUMEL * _ITEMSIZE[g], count=SMALL_COUNT)
              for g, b in pairs for m in methods]
    return [c for c in cases if c.supported]


# -- data and references (NumPy only) ------------------------------------------------------------
def float32_data(numel: int, seed: int) -> np.ndarray:
    """Non-constant float32 values (a tiled random block: cheap at 256 MiB)."""
    block = np.random.default_rng(seed).standard_normal(min(numel, _PERIOD)).astype(np.float32)
    return np.resize(block, numel)


def cast_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` (no NaN) as the bits of ``dtype``: round to nearest even, by integer
    arithmetic for bfloat16 (independent of ml-dtypes and MindSpore)."""
    if dtype == "float32":
        return values.view(np.uint32)
    if dtype == "float16":
        return values.astype(np.float16).view(np.uint16)
    words = values.view(np.uint32).astype(np.uint64)
    return ((words + 0x7FFF + ((words >> 16) & 1)) >> 16).astype(np.uint16)


def widen_bits(bits16: np.ndarray, dtype: str) -> np.ndarray:
    """bfloat16 bits as the bits of ``dtype`` (exact: bfloat16 is float32's high half)."""
    values = (bits16.astype(np.uint32) << 16).view(np.float32)
    return cast_bits(values, dtype)


def tensor_bits(tensor, count: int = None) -> np.ndarray:
    """A copy of ``tensor``'s bits as unsigned integers (first ``count`` elements)."""
    import mindspore as ms
    wide = tensor.dtype == ms.float32
    raw = tensor.view(ms.int16) if tensor.dtype == ms.bfloat16 else tensor
    out = np.frombuffer(raw.asnumpy().tobytes(), np.uint32 if wide else np.uint16)
    return out[:count].copy() if count is not None else out.copy()


def _check_equal(what: str, got: np.ndarray, want: np.ndarray) -> None:
    if got.shape != want.shape or not np.array_equal(got, want):
        bad = np.flatnonzero(got != want) if got.shape == want.shape else []
        where = f"; first difference at element {bad[0]} of {got.size}" if len(bad) else ""
        raise BenchmarkCheckError(f"{what}: result differs from the NumPy reference{where}")


# -- copy-in -------------------------------------------------------------------------------------
def make_copy(case: CopyCase) -> Callable[[], None]:
    import mindspore as ms
    from mindspore import mint

    from gradpool import pack as packing
    from gradpool import writers
    from gradpool.device import device_target, synchronize
    from gradpool.layout import ReduceScatterLayout
    from gradpool.pool import BucketPool

    grad_dtype, bucket_dtype = getattr(ms, case.grad_dtype), getattr(ms, case.bucket_dtype)
    per_grad = case.numel // case.count
    on_cpu = device_target() == "CPU"
    if case.method == "memcpy":
        # The bytes the pack writes, in one NumPy copy: the reference of every ratio.
        elements = case.bucket_nbytes // 4
        arrays = {"src": float32_data(elements, TIMED_SEED)}
        dst = np.empty_like(arrays["src"])

        def run():
            np.copyto(dst, arrays["src"])

        def check():
            arrays["src"] = float32_data(elements, CHECK_SEED)
            run()
            _check_equal(case.name, dst, arrays["src"])
        run.check = check
        return run

    grads: list = []

    def load(seed: int) -> None:
        values = float32_data(case.numel, seed).reshape(case.count, per_grad)
        grads[:] = [ms.Tensor(row).astype(grad_dtype) for row in values]

    def reference() -> np.ndarray:
        bits = np.concatenate([tensor_bits(g) for g in grads])
        if case.grad_dtype == case.bucket_dtype:
            return bits
        if case.grad_dtype == "bfloat16":
            return widen_bits(bits, case.bucket_dtype)
        return cast_bits(bits.view(np.float32), case.bucket_dtype)

    load(TIMED_SEED)
    layout = ReduceScatterLayout.build([(per_grad,)] * case.count, 1)
    last: dict = {}
    if case.method == "pool":
        pool = BucketPool(timed_copies=False)

        def run():
            lease = pool.acquire(layout.total_numel, bucket_dtype)
            written = writers.pack(lease, grads, layout, host=True)
            if not written.on_host:
                synchronize()          # device writes are queued; a NumPy write is done
            lease.release()

        def check():
            load(CHECK_SEED)
            run()
            # The pool has only ever had one bucket, so the lease taken now is the one run()
            # wrote (recycled without poison): read it back (the timed call records nothing).
            if pool.stats().new_allocations != 1:
                raise BenchmarkCheckError(f"{case.name}: the pool allocated more than one bucket")
            lease = pool.acquire(layout.total_numel, bucket_dtype)
            try:
                _check_equal(case.name, tensor_bits(lease.tensor, layout.total_numel),
                             reference())
            finally:
                lease.release()
        run.pool = pool
        run.check = check
        return run
    if case.method == "zero_copy":
        def run():
            # What the reducer hands the collective when it borrows: the gradient itself, as
            # 1-D (``flat_view`` queues no op for a 1-D gradient, nor on CPU at all).
            last["borrowed"] = packing.flat_view(grads[0])
            if not on_cpu:
                synchronize()

        def check():
            load(CHECK_SEED)
            run()
            borrowed = last["borrowed"]
            if borrowed.untyped_storage().data_ptr() != grads[0].untyped_storage().data_ptr():
                raise BenchmarkCheckError(f"{case.name}: the borrow is not the gradient's memory")
            _check_equal(case.name, tensor_bits(borrowed), reference())
        run.check = check
        return run

    def run():   # fresh_alloc: upstream style, a new buffer every step, copied into
        buffer = mint.cat(grads) if case.count > 1 else grads[0]
        out = mint.empty(layout.total_numel, dtype=bucket_dtype)
        out.copy_(buffer)
        synchronize()
        last["out"] = out

    def check():
        load(CHECK_SEED)
        run()
        _check_equal(case.name, tensor_bits(last["out"]), reference())
    run.check = check
    return run


def make_small_op() -> Callable[[], None]:
    """One small MindSpore op (a 1,024-element add), the unit for per-gradient dispatch cost."""
    import mindspore as ms
    from mindspore import mint

    from gradpool.device import synchronize
    x = ms.Tensor(np.ones(SMALL_NUMEL, np.float32))

    def run():
        for _ in range(SMALL_COUNT):
            mint.add(x, x)
        synchronize()
    return run


# -- reduce step: the whole reduce path for the test model's gradients ------------------------
REDUCE_METHODS = ("pool", "zero_copy")
# The pool copies into buckets aligned the shipped way (512 bytes, Ascend's rule); zero-copy uses
# 4-byte alignment, so every gradient whose dim 0 divides evenly by the world size has an
# identity layout and is borrowed in place instead of copied.
REDUCE_ALIGNMENT_BYTES = {"pool": 512, "zero_copy": 4}


@dataclass(frozen=True)
class ReduceCase:
    """One reduce step (pack or borrow -> reduce-scatter -> fence -> shard views -> recycle)
    over every gradient of the tiny DeepSeek-V3 model (default ModelConfig, float32)."""

    method: str            # "pool" (copy into pool buckets) or "zero_copy" (borrow where possible)
    comm_fusion: bool      # one fused bucket for all gradients, or one reduce-scatter each
    world_size: int

    @property
    def alignment_bytes(self) -> int:
        return REDUCE_ALIGNMENT_BYTES[self.method]

    @property
    def name(self) -> str:
        fusion = "fused" if self.comm_fusion else "per-grad"
        return f"reduce-{self.method}-{fusion}-w{self.world_size}"


def reduce_cases(world_size: int = 1) -> list[ReduceCase]:
    return [ReduceCase(m, f, world_size) for f in (False, True) for m in REDUCE_METHODS]


def model_grad_shapes(model_config=None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every trainable parameter of TinyDeepSeekV3 (default ModelConfig)."""
    from gradpool.app.model import TinyDeepSeekV3
    from gradpool.app.config import ModelConfig
    model = TinyDeepSeekV3(model_config or ModelConfig())
    return [(p.name, tuple(p.shape)) for p in model.trainable_params()]


def rank_grads(shapes, rank: int, seed: int) -> list[np.ndarray]:
    """Rank ``rank``'s float32 gradients (every rank can rebuild every other rank's)."""
    rng = np.random.default_rng([seed, rank])
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def reference_shards(shapes, world: int, rank: int, seed: int) -> list[np.ndarray]:
    """NumPy's reduce-scatter ``avg``: the float32 mean over ranks of each gradient, dim 0
    zero-padded to a multiple of ``world``, rank ``rank``'s chunk."""
    per_rank = [rank_grads(shapes, r, seed) for r in range(world)]
    out = []
    for index, shape in enumerate(shapes):
        total = per_rank[0][index].copy()
        for grads in per_rank[1:]:
            total += grads[index]
        mean = total / np.float32(world)
        chunk = -(-shape[0] // world)
        padded = np.zeros((chunk * world,) + tuple(shape[1:]), np.float32)
        padded[:shape[0]] = mean
        out.append(padded[rank * chunk:(rank + 1) * chunk])
    return out


def make_reduce_step(case: ReduceCase, comm, shapes=None) -> Callable[[], None]:
    """A callable running one whole reduce step of ``case`` over ``comm`` (whose world size must
    be ``case.world_size``). ``run.pool`` and ``run.reducer`` expose the pool statistics and the
    number of borrowed gradients; ``run.check()`` runs one step on new gradients and compares
    every shard with :func:`reference_shards`. Every rank of ``comm`` must make the same calls."""
    import mindspore as ms

    from gradpool.device import device_target, synchronize
    from gradpool.errors import InvalidArgumentError
    from gradpool.pool import BucketPool
    from gradpool.reducer import GradReducer, ReducerConfig

    if comm.world_size != case.world_size:
        raise InvalidArgumentError(f"{case.name} needs world size {case.world_size}, the "
                                   f"communicator has {comm.world_size}")
    shapes = [s for _, s in model_grad_shapes()] if shapes is None else list(shapes)
    grads: list = []

    def load(seed: int) -> None:
        grads[:] = [ms.Tensor(g) for g in rank_grads(shapes, comm.rank, seed)]

    load(TIMED_SEED)
    device = device_target()
    # timed_copies as the fully_shard runtime sets it (off on Ascend to keep copies overlapped).
    pool = BucketPool(device=device, alignment_bytes=case.alignment_bytes,
                      timed_copies=device != "Ascend")
    reducer = GradReducer(pool, comm, ReducerConfig(
        reduce_dtype=ms.float32, comm_fusion=case.comm_fusion,
        zero_copy=case.method == "zero_copy"))

    def step() -> list:
        if case.comm_fusion:
            results = [reducer.reduce_scatter(grads)]
        else:   # what fully_shard does without fusion: one collective per gradient
            results = [reducer.reduce_scatter([grad]) for grad in grads]
        for result in results:
            result.wait()
        synchronize()
        return results

    def run():
        for result in step():
            result.release()

    def check():
        load(CHECK_SEED)
        results = step()
        shards = results[0].wait() if case.comm_fusion else [r.wait()[0] for r in results]
        try:
            for index, (got, want) in enumerate(zip(shards, reference_shards(
                    shapes, comm.world_size, comm.rank, CHECK_SEED))):
                got = got.asnumpy()
                if got.shape != want.shape or not np.allclose(got, want, rtol=1e-6, atol=0):
                    raise BenchmarkCheckError(
                        f"{case.name}: shard of gradient {index} {shapes[index]} on rank "
                        f"{comm.rank} differs from NumPy's average over {comm.world_size} ranks")
        finally:
            for result in results:
                result.release()
            load(TIMED_SEED)
    run.pool = pool
    run.reducer = reducer
    run.check = check
    run.gradients = len(grads)
    run.grad_bytes = sum(int(np.prod(s)) * 4 for s in shapes)
    return run
