"""Prints the speed ratios the issues ask for, computed from the benchmarks of the same run."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))


def _timings(config):
    bench_session = getattr(config, "_benchmarksession", None)
    if bench_session is None or bench_session.disabled:
        return {}
    out = {}
    for bench in bench_session.benchmarks:
        if bench.stats is None or not bench.stats.rounds:
            continue
        info, stats = bench.extra_info, bench.stats
        key = (info.get("method"), info.get("grad_dtype"), info.get("bucket_dtype"),
               info.get("nbytes"), info.get("count"))
        out[key] = {"median_s": stats.median, "q1_s": stats.q1, "q3_s": stats.q3,
                    "iqr_s": stats.iqr, "min_s": stats.min, "max_s": stats.max,
                    "stddev_s": stats.stddev, "rounds": stats.rounds}
    return out


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from benchmarks.copy_table import copy_ratios
    timings = _timings(config)
    if not timings:
        return
    terminalreporter.section("gradpool copy-in speed (reference time / pool time, higher is "
                             "better)")
    for line in copy_ratios(timings):
        terminalreporter.write_line(line)
