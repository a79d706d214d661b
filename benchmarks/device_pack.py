"""The device pack (``host=False``, the path Ascend runs) timed on CPU: the median of 12 packs,
after 3 warm-up packs, for four fused buckets. Its figures are in
docs/benchmarks/host-path.md#device-pack-writes.

    python -m benchmarks.device_pack
"""
from __future__ import annotations

import statistics
import time

import mindspore as ms
import numpy as np

from gradpool import BucketPool, ReduceScatterLayout, itemsize, pack_bucket, synchronize

# name: (gradients, elements each (None: 255 x 257), gradient dtype, bucket dtype, world size)
CASES = {"fused 16 x 256 KiB f32, W=2": (16, 65536, ms.float32, ms.float32, 2),
         "fused 8 x 8 MiB f32, W=2": (8, 2 * 2**20, ms.float32, ms.float32, 2),
         "fused 16 x 256 KiB f32->bf16, W=2": (16, 65536, ms.float32, ms.bfloat16, 2),
         "fused 16 x (255x257) f32 uneven, W=4": (16, None, ms.float32, ms.float32, 4)}
WARMUP, TIMED = 3, 12


def time_case(pool: BucketPool, count: int, numel, src, dst, world: int) -> tuple[float, int]:
    """(median seconds of one pack, bucket bytes)."""
    rng = np.random.default_rng(0)
    shapes = [(numel,)] * count if numel else [(255, 257)] * count
    grads = [ms.Tensor(rng.standard_normal(s).astype(np.float32)).astype(src) for s in shapes]
    layout = ReduceScatterLayout.build(shapes, world, 1)
    lease = pool.acquire(layout.total_numel, dst)
    times = []
    try:
        for _ in range(WARMUP + TIMED):
            start = time.perf_counter()
            pack_bucket(lease, grads, layout, host=False)
            synchronize()
            times.append(time.perf_counter() - start)
    finally:
        lease.release()
    return statistics.median(times[WARMUP:]), layout.total_numel * itemsize(dst)


def main() -> int:
    ms.set_device("CPU")
    pool = BucketPool()
    for name, case in CASES.items():
        seconds, nbytes = time_case(pool, *case)
        print(f"{name}: median {seconds * 1e3:.2f} ms (bucket {nbytes / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
