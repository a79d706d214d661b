"""A launch ends with its launcher: signals to the launcher stop every rank, and a launcher that
dies without running any handler (SIGKILL) takes its ranks with it.

msrun and the ranks run in sessions of their own (the launcher starts msrun with
``start_new_session``, msrun its workers with ``setsid``), so a signal to the launcher, or to its
process group, reaches none of them: without this module they train on, reparented to init,
and keep writing checkpoints into the run's directory after the user "killed" the run.

* In the launcher, :class:`StopSignals` turns SIGTERM, SIGHUP and SIGINT into a request the
  launch loop acts on (:mod:`gradpool.app.launch`): stop msrun and every rank, say so in one
  line, then :class:`LaunchInterrupted` ends the process with 128 + the signal's number, the
  status a shell reports for a process a signal ended.
* In every process ``_rank_entry`` starts (ranks and msrun's scheduler), :func:`watch_launcher`
  starts a small watcher process (this file run as a script) that kills the process once the
  launcher named in ``$GRADPOOL_LAUNCHER`` is gone: it polls the launcher's ``/proc`` entry (pid
  and start time, so a reused pid does not count as alive). A process, not a thread: msrun's
  scheduler serves the cluster inside MindSpore's ``init()``, which holds the GIL, so a thread
  of its own never runs (seen: the scheduler outlived its killed launcher, and msrun waited for
  it). On Linux ``prctl(PR_SET_PDEATHSIG)`` also has the kernel kill the process when its parent
  (msrun, or the launcher for workers it starts itself) dies. A process started through
  ``gradpool launch-cmd`` by a cluster scheduler has no such variable and is not watched.

Standard library only: the scheduler process imports this before MindSpore.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional

LAUNCHER_ENV = "GRADPOOL_LAUNCHER"
WATCH_SECONDS = 0.2          # how soon a rank notices its launcher is gone
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
_PR_SET_PDEATHSIG = 1        # <linux/prctl.h>


class LaunchInterrupted(SystemExit):
    """The launcher got SIGTERM, SIGHUP or SIGINT and stopped msrun and every rank; unhandled, it
    ends the process with status 128 + ``signum`` and no traceback (the launcher logged the one
    line that says what was stopped)."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopSignals:
    """While active (a ``with`` block in the main thread), SIGTERM, SIGHUP and SIGINT only record
    the first signal in :attr:`signum`, for the launch loop to act on between polls: a handler
    that raised could fire inside ``subprocess`` bookkeeping, or again while the ranks are being
    stopped. Elsewhere (another thread cannot set handlers) it does nothing."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._previous: dict = {}

    def _record(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._record)
        return self

    def __exit__(self, *exc) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


def process_start(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks since boot, from ``/proc``), or None when it
    is gone, a zombie (killed, not yet reaped), or there is no ``/proc``."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]        # field 22 of stat(5); the first two (pid, comm) were split off


def launcher_identity() -> Optional[str]:
    """``pid:start`` of this process, for ``$GRADPOOL_LAUNCHER`` of the processes it starts (None
    without ``/proc``: nothing to watch by)."""
    start = process_start(os.getpid())
    return None if start is None else f"{os.getpid()}:{start}"


def _set_parent_death_signal(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass        # the watchdog thread still ends the process


def watch_launcher(environ: Mapping[str, str] = os.environ) -> Optional[subprocess.Popen]:
    """Have this process killed soon after the launcher ``environ[LAUNCHER_ENV]`` names is gone
    (and, on Linux, when its parent dies); the watcher process, or None when no launcher is
    named."""
    value = environ.get(LAUNCHER_ENV, "")
    pid_text, _, start = value.partition(":")
    if not pid_text.isdigit() or not start:
        return None
    parent = os.getppid()
    _set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:      # the parent died before the prctl took effect
        _orphaned(os.getpid(), f"its parent (pid {parent})")
    own_start = process_start(os.getpid())
    if own_start is None:
        return None                 # no /proc: nothing to watch by
    # -I -S: neither this directory (whose modules are no stdlib) nor site-packages on the
    # path: this file needs only the standard library, and starts faster
    return subprocess.Popen([sys.executable, "-I", "-S", os.path.abspath(__file__), pid_text, start,
                             str(os.getpid()), own_start], stdin=subprocess.DEVNULL)


def _watch(launcher: int, launcher_start: str, target: int, target_start: str) -> int:
    """The watcher's loop: kill ``target`` once ``launcher`` is gone; end once ``target`` is."""
    _set_parent_death_signal(signal.SIGKILL)        # the target is its parent
    while process_start(target) == target_start:
        if process_start(launcher) != launcher_start:
            _orphaned(target, f"the launcher (pid {launcher})")
            return 0
        time.sleep(WATCH_SECONDS)
    return 0


def _orphaned(target: int, what: str) -> None:
    # SIGKILL, not a request: the rank may sit in a collective for minutes, and a rank whose
    # launcher is gone must not reach its next checkpoint commit
    sys.stderr.write(f"gradpool: {what} is gone; ending process {target}\n")
    sys.stderr.flush()
    os.kill(target, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(_watch(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]))
