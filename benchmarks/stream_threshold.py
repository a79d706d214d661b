"""Where streaming stores start to pay on this CPU: the compiled host writers with streaming stores
on and off, against NumPy's memcpy, at sizes around the thresholds derived from the cache
(``gradpool.host.caches``). NumPy arrays only (no MindSpore), so the figures are the loops'.

    python -m benchmarks.stream_threshold [--sizes-mib 4,8,12,16,24,32,64] [--rounds 40] [--runs 3]

Per size, in one set of rounds stepped in turn: memcpy of the copy's bytes, the compiled copy
streaming and not (memmove), memcpy of the cast's bytes written, the compiled float32 -> bfloat16
cast streaming and not. Each figure is memcpy median / variant median (higher is faster), as the
min / median / max over ``--runs`` runs. Prints the CPU, its caches and the thresholds in use.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np

from benchmarks.copyin_api import stepped

NEVER = 1 << 62


def _stepped(calls: dict, rounds: int) -> dict:
    """Each call's median seconds, the calls stepped in turn (:func:`benchmarks.copyin_api.stepped`)."""
    return {name: statistics.median(values) for name, values in stepped(calls, rounds).items()}


def one_size(mib: float, rounds: int, runs: int) -> dict:
    from gradpool.host import kernels
    copy = kernels.address_writer("float32", "float32")
    narrow = kernels.bfloat16_kernel()
    numel = int(mib * 2**20) // 4
    src = np.resize(np.random.default_rng(1).standard_normal(65521).astype(np.float32), numel)
    dst = np.empty_like(src)
    out = np.empty(numel, np.uint16)
    half_src, half_dst = src[:numel // 2].copy(), np.empty(numel // 2, np.float32)

    def copy_with(threshold):
        def call():
            saved = kernels.COPY_STREAM_FROM_BYTES
            kernels.COPY_STREAM_FROM_BYTES = threshold
            try:
                copy(dst.ctypes.data, src.ctypes.data, numel)
            finally:
                kernels.COPY_STREAM_FROM_BYTES = saved
        return call
    calls = {"memcpy": lambda: np.copyto(dst, src),
             "copy streaming": copy_with(0), "copy memmove": copy_with(NEVER),
             "memcpy of cast bytes": lambda: np.copyto(half_dst, half_src),
             "cast streaming": lambda: narrow(src.view(np.uint32), out, 0),
             "cast ordinary": lambda: narrow(src.view(np.uint32), out, NEVER)}
    ratios: dict = {name: [] for name in ("copy streaming", "copy memmove", "cast streaming",
                                          "cast ordinary")}
    for _ in range(runs):
        medians = _stepped(calls, rounds)
        for name in ratios:
            reference = medians["memcpy" if name.startswith("copy") else "memcpy of cast bytes"]
            ratios[name].append(reference / medians[name])
    return ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stream_threshold",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="4,8,12,16,24,32,64",
                        help="copy sizes (the cast reads this many bytes, writes half)")
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    from benchmarks.copyin_api import cpu_row
    from gradpool.host import kernels
    kernels.compile_host_loops()
    machine = cpu_row()
    before = os.getloadavg()[0]
    print(f"CPU: {machine['cpu_model']}, {machine['cpus']} CPUs; caches {machine['caches']}; "
          f"thresholds in use: copy {machine['copy_stream_from_mib']:.3g} MiB, cast "
          f"{machine['cast_stream_from_mib']:.3g} MiB written ({machine['thresholds_from']}); "
          f"{args.rounds} rounds x {args.runs} runs, stepped in turn")
    print("| copy size | copy streaming | copy memmove | cast written | cast streaming | "
          "cast ordinary stores |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for mib in (float(x) for x in args.sizes_mib.split(",")):
        ratios = one_size(mib, args.rounds, args.runs)
        cells = {name: f"{min(v):.2f} / {statistics.median(v):.2f} / {max(v):.2f}"
                 for name, v in ratios.items()}
        print(f"| {mib:g} MiB | {cells['copy streaming']} | {cells['copy memmove']} | "
              f"{mib / 2:g} MiB | {cells['cast streaming']} | {cells['cast ordinary']} |",
              flush=True)
    print(f"(speed vs memcpy, min / median / max of runs; load average {before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
