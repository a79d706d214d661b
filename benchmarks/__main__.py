"""``python -m benchmarks run ...`` (time the suites) and ``python -m benchmarks report ...``.

Also what msrun runs on each rank when the runner relaunches itself (``benchmarks.runner``)."""
import sys

_USAGE = ("usage: python -m benchmarks run [--device CPU|Ascend] [--nproc N] [--out FILE] "
          "[--quick]\n"
          "       python -m benchmarks report RESULTS.json [--out-dir DIR]")


def main(argv) -> int:
    if not argv or argv[0] not in ("run", "report"):
        print(_USAGE, file=sys.stderr)
        return 2
    if argv[0] == "run":
        from benchmarks.runner import main as run_main
        return run_main(argv[1:])
    from benchmarks.report import main as report_main
    return report_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
