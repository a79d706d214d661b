"""Copy-in through the public reducer API against NumPy's memcpy, on the CPU it runs on.

    python -m benchmarks.copyin_api [--size-mib 64] [--padded] [--rounds 40] [--runs 3]
                                    [--variants]

One gradient of ``--size-mib`` MiB (its own dtype's bytes, as the copy-in sweep counts them) is
packed by ``GradReducer.pack`` into a pool bucket and the bucket discarded (``BucketPool`` and
``ReducerConfig`` defaults but the reduce dtype), for each dtype pair. With ``--padded`` the gradient has one element more, so its 512-byte
aligned bucket is padded past it and the general path writes it (what most gradients of odd
sizes, and every fused bucket, take), not the single-gradient address write. The reference is
``np.copyto`` of the bytes the pack writes between two NumPy arrays. The two are timed **stepped
in turn**, one call of each per round, ``--rounds`` rounds, and that ``--runs`` times; a run's
ratio is memcpy median / pool median (higher is better, 1 = memcpy's speed), and each row gives
the min / median / max of the runs' ratios; beside it, the ratio of the two fastest rounds (the
speed each reaches when the machine lets it, less moved by other processes on a shared machine). Every run ends by checking the bucket against NumPy
(ml_dtypes for bfloat16), so a pack that wrote nothing fails.

``--variants`` times, in the same rounds, the pieces of the same-dtype and cast paths one by one
(the compiled writer between the two addresses with streaming stores on and off, NumPy's copy into
the bucket, ml_dtypes' cast), which is how the table in docs/benchmarks/copy-in.md was taken.

Every row names the CPU (``/proc/cpuinfo``'s model name), its caches as sysfs reports them, the
streaming thresholds derived from them, and the load average before and after: the machine may
be shared, and a ratio taken under load is printed as such, not hidden.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np

PAIRS = (("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16"),
         ("bfloat16", "float32"))
_WIDTH = {"float32": 4, "bfloat16": 2}
GOALS = {True: 0.9, False: 0.5}      # same dtype, cast: fraction of memcpy's speed


@dataclass
class PairRun:
    """One dtype pair's callables (name -> zero-argument call) and its check."""

    calls: dict
    check: object
    written_bytes: int


def cpu_row() -> dict:
    """The CPU, its caches and the thresholds this process's host writers use."""
    from benchmarks.runner import _cpu_model
    from gradpool.host import caches
    found = caches.read_caches()
    thresholds = caches.stream_thresholds()
    return {"cpu_model": _cpu_model(), "cpus": os.cpu_count(),
            "caches": caches.describe_caches(found),
            "copy_stream_from_mib": thresholds.copy_from_bytes / 2**20,
            "cast_stream_from_mib": thresholds.cast_from_bytes / 2**20,
            "thresholds_from": thresholds.source}


def _ml_bits(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 ``values`` as ``dtype``'s bits, cast by ml_dtypes (the independent reference)."""
    import ml_dtypes
    if dtype == "float32":
        return values.astype(np.float32).view(np.uint32)
    return values.astype(ml_dtypes.bfloat16).view(np.uint16)


def make_pair(grad_dtype: str, bucket_dtype: str, nbytes: int, variants: bool,
              padded: bool = False) -> PairRun:
    import ml_dtypes
    import mindspore as ms

    from gradpool import BucketPool, GradReducer, ReducerConfig, SingleProcessCommunicator
    from gradpool.dtypes import data_pointer, host_address, host_alias
    from gradpool.host import kernels, writer

    numel = nbytes // _WIDTH[grad_dtype] + (1 if padded else 0)
    values = np.resize(np.random.default_rng(5).standard_normal(65521).astype(np.float32), numel)
    grad = ms.Tensor(values).astype(getattr(ms, grad_dtype))
    pool = BucketPool()
    reducer = GradReducer(pool, SingleProcessCommunicator(),
                          ReducerConfig(reduce_dtype=getattr(ms, bucket_dtype)))
    written = numel * _WIDTH[bucket_dtype]
    ref_src = np.resize(values.view(np.uint32), written // 4)
    ref_dst = np.empty_like(ref_src)

    def pool_pack():
        reducer.discard(reducer.pack([grad]))

    calls = {"memcpy": lambda: np.copyto(ref_dst, ref_src), "pool": pool_pack}
    if variants and padded:
        def strided_numpy():
            saved = writer._RUN_FROM_BYTES
            writer._RUN_FROM_BYTES = 1 << 62
            try:
                pool_pack()
            finally:
                writer._RUN_FROM_BYTES = saved
        calls["pool, one strided NumPy write (before)"] = strided_numpy
    elif variants:
        lease = pool.acquire(numel, getattr(ms, bucket_dtype))
        dst, src = data_pointer(lease.allocation), host_address(grad)
        bucket, source = host_alias(lease.allocation)[:numel], host_alias(grad)
        lease.release()                  # the pool keeps the bucket; pool_pack reuses it
        write = kernels.address_writer(grad_dtype, bucket_dtype)

        def with_threshold(name: str, value: int):
            def call():
                saved = getattr(kernels, name)
                setattr(kernels, name, value)
                try:
                    write(dst, src, numel)
                finally:
                    setattr(kernels, name, saved)
            return call
        if grad_dtype == bucket_dtype:
            calls["compiled streaming"] = with_threshold("COPY_STREAM_FROM_BYTES", 0)
            calls["compiled memmove"] = with_threshold("COPY_STREAM_FROM_BYTES", 1 << 62)
            calls["np.copyto into bucket"] = lambda: np.copyto(bucket, source)
        elif grad_dtype == "float32":
            calls["compiled streaming"] = with_threshold("STREAM_FROM_BYTES", 0)
            calls["compiled ordinary stores"] = with_threshold("STREAM_FROM_BYTES", 1 << 62)
            calls["ml_dtypes into bucket"] = lambda: np.copyto(bucket, source, casting="unsafe")
        else:
            calls["compiled widen"] = lambda: write(dst, src, numel)
            calls["ml_dtypes into bucket"] = lambda: np.copyto(bucket, source, casting="unsafe")

    def check():
        buckets = reducer.pack([grad])
        try:
            got = np.frombuffer(buckets[0].input_tensor.view(
                ms.int32 if bucket_dtype == "float32" else ms.int16).asnumpy().tobytes(),
                np.uint32 if bucket_dtype == "float32" else np.uint16)[:numel]
            as_grad = values if grad_dtype == "float32" else \
                values.astype(ml_dtypes.bfloat16).astype(np.float32)
            want = _ml_bits(as_grad, bucket_dtype)
            if not np.array_equal(got, want):
                raise AssertionError(f"{grad_dtype}->{bucket_dtype}: the bucket differs from "
                                     "NumPy's cast of the gradient")
        finally:
            reducer.discard(buckets)
    return PairRun(calls, check, written)


def stepped(calls: dict, rounds: int) -> dict:
    """Each call's seconds per round, one call of each per round, in turn (after one warm-up)."""
    for call in calls.values():
        call()
    samples = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - start)
    return samples


def measure(size_mib: int, rounds: int, runs: int, variants: bool,
            padded: bool = False) -> list[dict]:
    rows = []
    for grad_dtype, bucket_dtype in PAIRS:
        pair = make_pair(grad_dtype, bucket_dtype, size_mib << 20, variants, padded)
        ratios: dict = {name: [] for name in pair.calls if name != "memcpy"}
        fastest: dict = {name: [] for name in ratios}
        memcpy_ms = []
        for _ in range(runs):
            samples = stepped(pair.calls, rounds)
            reference = samples["memcpy"]
            memcpy_ms.append(statistics.median(reference) * 1e3)
            for name in ratios:
                ratios[name].append(statistics.median(reference) / statistics.median(samples[name]))
                fastest[name].append(min(reference) / min(samples[name]))
            pair.check()
        for name, values in ratios.items():
            rows.append({"pair": f"{grad_dtype} -> {bucket_dtype}", "what": name,
                         "goal": GOALS[grad_dtype == bucket_dtype] if name == "pool" else None,
                         "min": min(values), "median": statistics.median(values),
                         "max": max(values), "fastest": statistics.median(fastest[name]),
                         "memcpy_ms": statistics.median(memcpy_ms),
                         "written_mib": pair.written_bytes / 2**20})
        del pair
    return rows


def table(rows: list[dict], machine: dict, load: tuple, args) -> str:
    lines = [f"CPU: {machine['cpu_model']}, {machine['cpus']} CPUs; caches {machine['caches']}; "
             f"streaming from {machine['copy_stream_from_mib']:.3g} MiB (copy), "
             f"{machine['cast_stream_from_mib']:.3g} MiB (cast) written, from "
             f"{machine['thresholds_from']}",
             f"gradient {args.size_mib} MiB" + (" + 1 element, padded bucket" if args.padded
                                                 else ", bucket = the flat gradient") + ", "
             f"{args.rounds} rounds stepped in turn x {args.runs} "
             f"runs; load average {load[0]:.1f} before, {load[1]:.1f} after",
             "", "| CPU | gradient -> bucket | path | written | memcpy median | speed vs "
             "memcpy (ratio of medians): min / median / max of runs | goal | fastest rounds' "
             "ratio (median of runs) |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        goal = f">= {row['goal']}" if row["goal"] else ""
        if row["goal"]:
            goal += " met" if row["median"] >= row["goal"] else " missed"
        lines.append(f"| {machine['cpu_model']} | {row['pair']} | {row['what']} | "
                     f"{row['written_mib']:g} MiB | {row['memcpy_ms']:.2f} ms | "
                     f"{row['min']:.2f} / {row['median']:.2f} / {row['max']:.2f} | {goal} | "
                     f"{row['fastest']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.copyin_api",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--padded", action="store_true",
                        help="one element more: a padded bucket, written by the general path")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", action="store_true",
                        help="also time the pieces of each path in the same rounds")
    args = parser.parse_args(argv)
    import mindspore as ms
    ms.set_device("CPU")
    from gradpool.device import block_launches
    block_launches()                      # as gradpool train runs CPU ranks
    before = os.getloadavg()[0]
    rows = measure(args.size_mib, args.rounds, args.runs, args.variants, args.padded)
    print(table(rows, cpu_row(), (before, os.getloadavg()[0]), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
