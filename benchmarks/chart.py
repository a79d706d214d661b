"""The copy-overhead chart: pool copy-in time relative to zero-copy and to memcpy, by size."""
from __future__ import annotations

from pathlib import Path

from benchmarks.cases import MIB
from benchmarks.report import copy_medians, copy_rows

_PANELS = (("pool_vs_zero_copy_time", "pool time / zero-copy time",
            "against zero-copy (same dtype only)"),
           ("memcpy_vs_pool_time", "pool time / memcpy time", "against NumPy memcpy"))


def _series(rows: list) -> dict:
    """``{pair: [(nbytes, {ratio name: value})]}`` for single-gradient rows, by size."""
    out: dict = {}
    for row in sorted((r for r in rows if r["count"] == 1), key=lambda r: r["nbytes"]):
        ratios = {}
        if "pool_vs_zero_copy_time" in row:
            ratios["pool_vs_zero_copy_time"] = row["pool_vs_zero_copy_time"]
        if "pool_vs_memcpy_bandwidth" in row:
            ratios["memcpy_vs_pool_time"] = 1.0 / row["pool_vs_memcpy_bandwidth"]
        pair = f"{row['grad_dtype']} -> {row['bucket_dtype']}"
        out.setdefault(pair, []).append((row["nbytes"], ratios))
    return out


def plot_copy_overhead(results: dict, path: Path) -> bool:
    """Write the PNG; False (nothing written) when ``results`` has no copy timings."""
    series = _series(copy_rows(copy_medians(results)))
    if not series:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {pair: f"C{i}" for i, pair in enumerate(sorted(series))}   # same in both panels
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (key, ylabel, title) in zip(axes, _PANELS):
        for pair, points in sorted(series.items()):
            xs = [n / MIB for n, r in points if key in r]
            ys = [r[key] for _, r in points if key in r]
            if xs:
                ax.plot(xs, ys, marker="o", label=pair, color=colors[pair])
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("gradient size (MiB)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    machine = results.get("machine", {})
    fig.suptitle(f"gradpool copy-in overhead ({machine.get('device', '?')}, "
                 f"{machine.get('cpu_model', '?')}, MindSpore {machine.get('mindspore', '?')})",
                 fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
