"""Benchmark cases shared by the pytest-benchmark suites and the ``python -m benchmarks`` runner.

Each ``make_*`` function does the set-up and returns a zero-argument callable that runs one
measured iteration to completion (it synchronizes the device, since PyNative launches ops
asynchronously and an unsynchronized timing measures only the launch).
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


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB}MiB" if nbytes >= MIB else f"{nbytes // KIB}KiB"


def copy_cases(sizes=COPY_SIZES, pairs=DTYPE_PAIRS, methods=METHODS) -> list[CopyCase]:
    cases = [CopyCase(m, g, b, n) for n in sizes for g, b in pairs for m in methods]
    cases += [CopyCase(m, g, b, SMALL_COUNT * SMALL_NUMEL * (4 if g == "float32" else 2),
                       count=SMALL_COUNT) for g, b in pairs for m in methods]
    return [c for c in cases if c.supported]


def make_copy(case: CopyCase) -> Callable[[], None]:
    import mindspore as ms
    from mindspore import mint

    from gradpool import pack as packing
    from gradpool.device import synchronize
    from gradpool.layout import ReduceScatterLayout
    from gradpool.pool import BucketPool

    grad_dtype, bucket_dtype = getattr(ms, case.grad_dtype), getattr(ms, case.bucket_dtype)
    per_grad = case.nbytes // case.count // (4 if case.grad_dtype == "float32" else 2)
    if case.method == "memcpy":
        src = np.full(case.nbytes // 4, 0.5, np.float32)
        dst = np.empty_like(src)
        return lambda: np.copyto(dst, src)
    grads = [ms.Tensor(np.full(per_grad, 0.5, np.float32)).astype(grad_dtype)
             for _ in range(case.count)]
    layout = ReduceScatterLayout.build([(per_grad,)] * case.count, 1)
    if case.method == "pool":
        pool = BucketPool(timed_copies=False)

        def run():
            lease = pool.acquire(layout.total_numel, bucket_dtype)
            packing.pack(lease, grads, layout, host=True)
            synchronize()
            lease.release()
        run.pool = pool
        return run
    if case.method == "zero_copy":
        def run():
            borrowed = grads[0].view(per_grad)   # what the collective would read in place
            synchronize()
            return borrowed
        return run

    def run():   # fresh_alloc: upstream style, a new buffer every step, copied into
        buffer = mint.cat(grads) if case.count > 1 else grads[0]
        out = mint.empty(layout.total_numel, dtype=bucket_dtype)
        out.copy_(buffer)
        synchronize()
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


def make_reduce_step(case: ReduceCase, comm, shapes=None) -> Callable[[], None]:
    """A callable running one whole reduce step of ``case`` over ``comm`` (whose world size must
    be ``case.world_size``). ``run.pool`` and ``run.reducer`` expose the pool statistics and the
    number of borrowed gradients. Every rank of ``comm`` must call it the same number of times."""
    import mindspore as ms

    from gradpool.device import device_target, synchronize
    from gradpool.errors import InvalidArgumentError
    from gradpool.pool import BucketPool
    from gradpool.reducer import GradReducer, ReducerConfig

    if comm.world_size != case.world_size:
        raise InvalidArgumentError(f"{case.name} needs world size {case.world_size}, the "
                                   f"communicator has {comm.world_size}")
    shapes = [s for _, s in model_grad_shapes()] if shapes is None else list(shapes)
    rng = np.random.default_rng([7, comm.rank])
    grads = [ms.Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]
    device = device_target()
    # timed_copies as the fully_shard runtime sets it (off on Ascend to keep copies overlapped).
    pool = BucketPool(device=device, alignment_bytes=case.alignment_bytes,
                      timed_copies=device != "Ascend")
    reducer = GradReducer(pool, comm, ReducerConfig(
        reduce_dtype=ms.float32, comm_fusion=case.comm_fusion,
        zero_copy=case.method == "zero_copy"))

    def run():
        if case.comm_fusion:
            results = [reducer.reduce_scatter(grads)]
        else:   # what fully_shard does without fusion: one collective per gradient
            results = [reducer.reduce_scatter([grad]) for grad in grads]
        for result in results:
            result.wait()
        synchronize()
        for result in results:
            result.release()
    run.pool = pool
    run.reducer = reducer
    run.gradients = len(grads)
    run.grad_bytes = sum(int(np.prod(s)) * 4 for s in shapes)
    return run
