"""The copy-in chart: pool speed relative to memcpy and to a fresh allocation, by gradient size.

Same direction as every table (reference time / pool time: higher is better, 1 = parity), error
bars from the interquartile ranges of both sides, sizes labelled 4 KiB ... 256 MiB.
"""
from __future__ import annotations

from pathlib import Path

from benchmarks.copy_table import REFERENCES, copy_rows, copy_timings, size_label

_PANELS = (("speed_vs_memcpy", "memcpy", "against NumPy memcpy of the bytes written"),
           ("speed_vs_fresh_alloc", "fresh_alloc",
            "against an upstream-style fresh allocation + copy"))


def _series(rows: list) -> dict:
    """``{pair: [(nbytes, {ratio name: ratio})]}`` for single-gradient rows, by size."""
    out: dict = {}
    for row in sorted((r for r in rows if r["count"] == 1), key=lambda r: r["nbytes"]):
        pair = f"{row['grad_dtype']} -> {row['bucket_dtype']}"
        out.setdefault(pair, []).append((row["nbytes"], row["ratios"]))
    return out


def plot_copy_speed(results: dict, path: Path) -> bool:
    """Write the PNG; False (nothing written) when ``results`` has no copy timings."""
    series = _series(copy_rows(copy_timings(results)))
    if not series:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {pair: f"C{i}" for i, pair in enumerate(sorted(series))}   # same in both panels
    sizes = sorted({n for points in series.values() for n, _ in points})
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (key, reference, title) in zip(axes, _PANELS):
        for offset, (pair, points) in enumerate(sorted(series.items())):
            kept = [(n, r[key]) for n, r in points if key in r]
            if not kept:
                continue
            # Nudge each pair sideways a little so overlapping error bars stay readable.
            xs = [n * (1.06 ** (offset - 1.5)) for n, _ in kept]
            ys = [r["median"] for _, r in kept]
            below = [r["median"] - r["low"] for _, r in kept]
            above = [r["high"] - r["median"] for _, r in kept]
            ax.errorbar(xs, ys, yerr=[below, above], marker="o", capsize=3, label=pair,
                        color=colors[pair])
        ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--",
                   label=f"1 = as fast as the {REFERENCES[reference].split(' (')[0]}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xticklabels([size_label(n) for n in sizes], rotation=30)
        ax.minorticks_off()
        ax.set_xlabel("gradient size")
        ax.set_ylabel("speed relative to reference (reference time / pool time)")
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    machine = results.get("machine", {})
    fig.suptitle("gradpool copy-in speed, higher is better (median, error bars: interquartile "
                 f"range)\n{machine.get('device', '?')}, {machine.get('cpu_model', '?')}, "
                 f"MindSpore {machine.get('mindspore', '?')}", fontsize=11)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
