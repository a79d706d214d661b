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

    from gradpool import copy as gcopy
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
            gcopy.pack(lease, grads, layout)
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
