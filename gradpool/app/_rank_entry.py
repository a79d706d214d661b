"""What msrun starts on each rank under ``gradpool.launch``: the user's script, plus two lines in
the rank's own log that say which process it was and how it ended.

msrun itself reports only the pid and exit code of the *first* worker that fails, and then kills
the others; it never says which rank a pid was. So ``run_ranks`` launches
``python -m gradpool._rank_entry SCRIPT ARGS...`` and reads these lines back from
``worker_<rank>.log``. The script runs as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as
``python SCRIPT ARGS...`` would set them.
"""
from __future__ import annotations

import os
import re
import runpy
import sys
import traceback

MARKER = "[gradpool.launch]"
_LINE = re.compile(re.escape(MARKER) +
                   r" rank=(?P<rank>\S+) role=(?P<role>\S*) pid=(?P<pid>\d+) (?P<event>started|exit_code=(?P<code>-?\d+))$")


def parse_line(line: str):
    """``(rank, role, pid, exit_code or None for the start line)`` of a marker line, else None."""
    match = _LINE.match(line.strip())
    if match is None:
        return None
    code = match.group("code")
    return match.group("rank"), match.group("role"), int(match.group("pid")), \
        None if code is None else int(code)


def _say(event: str) -> None:
    rank = os.environ.get("RANK_ID", "?")
    role = os.environ.get("MS_ROLE", "")
    sys.stdout.flush()
    sys.stderr.flush()
    print(f"{MARKER} rank={rank} role={role} pid={os.getpid()} {event}", flush=True)


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
        print("usage: python -m gradpool._rank_entry SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script = os.path.abspath(argv[0])
    sys.argv = [script] + argv[1:]
    sys.path[0] = os.path.dirname(script)     # what ``python SCRIPT`` puts first
    _say("started")
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - report any failure as Python would, exit code 1
        traceback.print_exc()
        code = 1
    _say(f"exit_code={code}")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
