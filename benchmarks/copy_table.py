"""The copy-in timings as rows of ratios: what the report, the chart and ``benchmarks/conftest.py``
all read (speed relative to a reference = reference time / pool time; higher is better, 1 is
parity, each with the range from both sides' interquartile ranges)."""
from __future__ import annotations

from typing import Optional

from benchmarks.cases import MIB, SMALL_COUNT

Key = tuple  # (method, grad_dtype, bucket_dtype, nbytes, count)
REFERENCES = {"memcpy": "NumPy memcpy of the bytes the pack writes",
              "fresh_alloc": "upstream-style fresh allocation + copy",
              "zero_copy": "zero-copy borrow (same dtype only)"}


def size_label(nbytes: int) -> str:
    """4 KiB, 1 MiB, 256 MiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def time_label(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def timing_of(row: dict) -> dict:
    """The timing fields of a result row (schema 1 files have no quartiles: median stands in)."""
    median = row["median_s"]
    return {"median_s": median, "q1_s": row.get("q1_s", median), "q3_s": row.get("q3_s", median),
            "iqr_s": row.get("iqr_s"), "min_s": row.get("min_s"), "max_s": row.get("max_s"),
            "stddev_s": row.get("stddev_s"), "rounds": row.get("rounds", row.get("repeats"))}


def speed_ratio(reference: dict, pool: dict, per_reference: float = 1.0,
                per_pool: float = 1.0) -> dict:
    """Reference time / pool time (each divided by its ``per_*`` count), with the IQR range."""
    ref = {k: reference[k] / per_reference for k in ("median_s", "q1_s", "q3_s")}
    mine = {k: pool[k] / per_pool for k in ("median_s", "q1_s", "q3_s")}
    return {"median": ref["median_s"] / mine["median_s"],
            "low": ref["q1_s"] / mine["q3_s"], "high": ref["q3_s"] / mine["q1_s"]}


PAIRED = "paired_pool:"      # key prefix: the pool series timed next to one reference only


def copy_rows(timings: dict) -> list[dict]:
    """One row per (dtype pair, size, count): each method's timing and the pool's speed ratios.

    ``timings`` maps ``(method, grad_dtype, bucket_dtype, nbytes, count)`` to a timing dict
    (:func:`timing_of`); the small-op reference is ``("small_op", None, None, None, count)``.
    A reference timed against a pool series of its own (``(PAIRED + method, ...)``) is compared
    with that series, every other one with the pool row."""
    rows = []
    groups = sorted({k[1:] for k in timings if k[0] == "pool"},
                    key=lambda g: (g[3], g[0], g[1], g[2]))
    small_op = timings.get(("small_op", None, None, None, SMALL_COUNT))
    for grad_dtype, bucket_dtype, nbytes, count in groups:
        times = {m: timings.get((m, grad_dtype, bucket_dtype, nbytes, count))
                 for m in ("pool", *REFERENCES)}
        paired = {m: timings.get((PAIRED + m, grad_dtype, bucket_dtype, nbytes, count))
                  for m in REFERENCES}
        pool = times["pool"]
        ratios = {f"speed_vs_{m}": speed_ratio(times[m], paired[m] or pool)
                  for m in REFERENCES if times[m]}
        if count > 1 and small_op:
            # One small op per gradient is what a per-parameter loop of ops would pay.
            ratios["speed_vs_small_op"] = speed_ratio(small_op, pool, SMALL_COUNT, count)
        rows.append(dict(grad_dtype=grad_dtype, bucket_dtype=bucket_dtype, nbytes=nbytes,
                         count=count, timings=times, pool_gbps=nbytes / pool["median_s"] / 1e9,
                         ratios=ratios,
                         paired_pool={m: t for m, t in paired.items() if t is not None}))
    return rows


def copy_ratios(timings: dict) -> list[str]:
    """One line per copy row (what ``benchmarks/conftest.py`` prints after a pytest run)."""
    lines = []
    for row in copy_rows(timings):
        what = f"{row['count']} x " if row["count"] > 1 else ""
        pool = row["timings"]["pool"]
        text = (f"pool {row['grad_dtype']}->{row['bucket_dtype']} {what}"
                f"{size_label(row['nbytes'])}: {time_label(pool['median_s'])} "
                f"(IQR {time_label(pool['iqr_s'])}), {row['pool_gbps']:.2f} GB/s; speed vs")
        text += ", ".join(f" {name[len('speed_vs_'):]} {r['median']:.3g}"
                          for name, r in row["ratios"].items())
        lines.append(text)
    return lines


def copy_timings(results: dict) -> dict:
    """The runner's copy rows as the ``{Key: timing}`` dict :func:`copy_rows` takes."""
    copy = results.get("copy") or {}
    timings = {(c["method"], c["grad_dtype"], c["bucket_dtype"], c["nbytes"], c["count"]):
               timing_of(c) for c in copy.get("cases", [])}
    timings.update({(PAIRED + c["method"], c["grad_dtype"], c["bucket_dtype"], c["nbytes"],
                     c["count"]): timing_of(c["paired_pool"])
                    for c in copy.get("cases", []) if c.get("paired_pool")})
    small = copy.get("small_op")
    if small:
        timings[("small_op", None, None, None, small["count"])] = timing_of(small)
    return timings
