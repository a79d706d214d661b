"""What msrun starts on each rank under ``gradpool.launch``: the user's script, wrapped so the
rank's report (:mod:`gradpool.app.rank_report`) says which process it was and how it ended.

msrun itself reports only the pid and exit code of the *first* worker that fails, and then kills
the others; it never says which rank a pid was. So ``run_ranks`` launches
``python -m gradpool.app._rank_entry SCRIPT ARGS...``, which writes this rank's report (rank,
pid, ``MS_ROLE``, status ``running``) before the script starts and the exit code after it ends;
the launcher polls those reports while msrun runs. The script runs as ``__main__`` with
``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS...`` would set them, and publishes its
own results into the same report (``rank_report.reporter_for``).
"""
from __future__ import annotations

import os
import runpy
import sys
import traceback

from gradpool.app import lifeline, rank_report


def _exit_code(code) -> int:
    """The process exit status Python would give ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m gradpool.app._rank_entry SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    lifeline.watch_launcher()       # a launcher killed outright takes this process with it
    if os.environ.get("MS_ROLE") == "MS_SCHED":
        return _serve_cluster()
    script = os.path.abspath(argv[0])
    sys.argv = [script] + argv[1:]
    sys.path[0] = os.path.dirname(script)     # what ``python SCRIPT`` puts first
    # None in msrun's scheduler process (it has no rank) and outside run_ranks.
    reporter = rank_report.launched_reporter()
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - report any failure as Python would, exit code 1
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if reporter is not None:
        reporter.finish(code)
    return code


def _serve_cluster() -> int:
    """msrun's scheduler process: it only serves the cluster, inside ``init()``, until the
    workers are done. It skips the script, whose imports would compete for the cores with the
    workers' own while they start (the script's first step, ``init()``, is all it ran here)."""
    from mindspore.communication import init
    init()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
