"""Turns benchmark medians into the ratios the project reports (shared by conftest and the runner)."""
from __future__ import annotations

from benchmarks.cases import MIB, SMALL_COUNT

Key = tuple  # (method, grad_dtype, bucket_dtype, nbytes, count)


def _size(nbytes: int) -> str:
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes / 1024:g} KiB"


def copy_rows(medians: dict) -> list[dict]:
    """One row per (dtype pair, size, count) with each method's time and the pool's ratios."""
    rows = []
    groups = sorted({k[1:] for k in medians if k[0] == "pool"}, key=lambda g: (g[3], g[0], g[1], g[2]))
    small_op = medians.get(("small_op", None, None, None, SMALL_COUNT))
    for grad_dtype, bucket_dtype, nbytes, count in groups:
        times = {m: medians.get((m, grad_dtype, bucket_dtype, nbytes, count))
                 for m in ("pool", "zero_copy", "fresh_alloc", "memcpy")}
        pool = times["pool"]
        row = dict(grad_dtype=grad_dtype, bucket_dtype=bucket_dtype, nbytes=nbytes, count=count,
                   seconds=times, pool_gbps=nbytes / pool / 1e9)
        if times["memcpy"]:
            row["pool_vs_memcpy_bandwidth"] = times["memcpy"] / pool
        if times["fresh_alloc"]:
            row["pool_vs_fresh_alloc_time"] = pool / times["fresh_alloc"]
        if times["zero_copy"]:
            row["pool_vs_zero_copy_time"] = pool / times["zero_copy"]
        if count > 1 and small_op:
            row["per_gradient_op_units"] = (pool / count) / (small_op / SMALL_COUNT)
        rows.append(row)
    return rows


def copy_ratios(medians: dict) -> list[str]:
    lines = []
    for row in copy_rows(medians):
        what = f"{row['count']} x " if row["count"] > 1 else ""
        text = (f"pool {row['grad_dtype']}->{row['bucket_dtype']} {what}{_size(row['nbytes'])}: "
                f"{row['pool_gbps']:.2f} GB/s")
        if "pool_vs_memcpy_bandwidth" in row:
            text += f", {row['pool_vs_memcpy_bandwidth']:.2f} x memcpy bandwidth"
        if "pool_vs_fresh_alloc_time" in row:
            text += f", {row['pool_vs_fresh_alloc_time']:.2f} x fresh-alloc time"
        if "per_gradient_op_units" in row:
            text += f", {row['per_gradient_op_units']:.2f} small ops per gradient"
        lines.append(text)
    return lines
