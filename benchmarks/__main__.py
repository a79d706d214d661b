"""``python -m benchmarks run ...`` (time the suites), ``python -m benchmarks report ...`` and
``python -m benchmarks compare OLD.json NEW.json [--fail-above PCT]``.

Also what msrun runs on each rank when the runner relaunches itself (``benchmarks.runner``)."""
import sys
from pathlib import Path

if not __package__:       # run as a script (msrun relaunches this file): the package is not
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # installed, its root is here

_USAGE = ("usage: python -m benchmarks run [--device CPU|Ascend] [--nproc N] [--out FILE] "
          "[--quick]\n"
          "       python -m benchmarks report RESULTS.json [--out-dir DIR]\n"
          "       python -m benchmarks compare OLD.json NEW.json [--fail-above PCT]")


def main(argv) -> int:
    if not argv or argv[0] not in ("run", "report", "compare"):
        print(_USAGE, file=sys.stderr)
        return 2
    if argv[0] == "run":
        from benchmarks.runner import main as run_main
        return run_main(argv[1:])
    if argv[0] == "compare":
        from benchmarks.report import compare_main
        return compare_main(argv[1:])
    from benchmarks.report import main as report_main
    return report_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
