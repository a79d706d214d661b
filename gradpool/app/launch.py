"""Run a Python script on N local CPU ranks with MindSpore's own launcher, ``msrun``.

``run_ranks`` is a thin wrapper: it picks a free scheduler port and a log directory, runs ::

    msrun --worker_num=N --local_worker_num=N --master_port=PORT --log_dir=DIR --join=True \\
          python -m gradpool.app._rank_entry SCRIPT ARGS...

and reports every rank's exit code and log tail. ``_rank_entry`` runs SCRIPT unchanged; it only
writes the rank's report (:mod:`gradpool.app.rank_report`, in ``report_dir``, which the ranks
find in ``$GRADPOOL_RANK_REPORT_DIR``): rank and pid at the start, the exit code at the end, as
msrun itself names only the pid of the first worker that failed. msrun's own "Worker process PID
exit with exception. Error code: N" line still wins for that pid: it is the real process status
(a crash after the script ended, a signal).

While msrun runs, the launcher polls the reports. Once a rank has exited non-zero, or its
process is gone without an exit record, msrun gets ``failure_grace`` seconds to end by itself;
after that the launcher stops msrun and every rank and raises. msrun alone can take much longer:
it sees a rank only when the rank's process ends (a non-daemon thread can keep a failed rank's
process alive), and after killing the other workers it waits for MindSpore's scheduler, which
waits out the dead node's heartbeat timeout.

Facts this relies on (MindSpore 2.10, measured): msrun runs ``python`` from ``PATH`` (so this
interpreter's directory goes first on the workers' ``PATH``); it writes ``worker_<rank>.log``
and ``scheduler.log`` into ``--log_dir``; the scheduler process runs the same command with
``MS_ROLE=MS_SCHED`` (it serves the cluster from inside ``communication.init()``); a 2-rank launch
costs ~14 s on 2 cores, ~6 s of it import and init, so run many cases per launch.

CLI: ``python -m gradpool.launch --nproc 2 script.py ARGS...``.
"""
from __future__ import annotations

import argparse
import collections
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from gradpool.app import _rank_entry, rank_report
from gradpool.app.rank_report import RankReport
from gradpool.errors import InvalidArgumentError, LaunchError

logger = logging.getLogger("gradpool.launch")   # also when run as __main__

TAIL_LINES = 60
# msrun (process_entity/_api.py) logs this for the first worker that exits non-zero.
_MSRUN_FAILURE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
_STOP_GRACE_SECONDS = 20.0
POLL_SECONDS = 0.5
FAILURE_GRACE_SECONDS = 5.0     # after a rank failed, how long msrun may take to end by itself


@dataclass(frozen=True)
class RankResult:
    """How one rank ended. ``exit_code`` is None when no exit was recorded: msrun or the launcher
    killed the rank after another one failed, the launch timed out while it ran, or (``vanished``)
    its process ended without recording one (a signal, ``os._exit``)."""

    rank: int
    exit_code: Optional[int]
    pid: Optional[int]
    log_path: Path
    log_tail: str
    report: Optional[RankReport] = None     # None: the rank never started its report
    vanished: bool = False

    def describe(self) -> str:
        if self.vanished:
            return (f"rank {self.rank}: process {self.pid} ended without recording an exit code "
                    "(killed by a signal, or os._exit)")
        if self.exit_code is None:
            return (f"rank {self.rank}: no exit recorded (killed by msrun or the launcher after "
                    "another rank failed, or stopped on timeout)")
        return f"rank {self.rank}: exit code {self.exit_code}"


@dataclass(frozen=True)
class LaunchResult:
    command: tuple[str, ...]
    log_dir: Path
    returncode: Optional[int]        # msrun's own; None when the launcher stopped it
    seconds: float
    ranks: tuple[RankResult, ...]
    timed_out: bool = False
    report_dir: Optional[Path] = None
    stopped_for: Optional[int] = None     # the failed rank the launcher stopped the launch for

    @property
    def exit_codes(self) -> tuple[Optional[int], ...]:
        return tuple(r.exit_code for r in self.ranks)

    @property
    def log_tails(self) -> tuple[str, ...]:
        return tuple(r.log_tail for r in self.ranks)

    @property
    def failed_ranks(self) -> tuple[RankResult, ...]:
        return tuple(r for r in self.ranks if r.exit_code not in (0, None) or r.vanished)

    @property
    def ok(self) -> bool:
        return (not self.timed_out and self.stopped_for is None and self.returncode == 0
                and all(code == 0 for code in self.exit_codes))


def run_ranks(script, args: Sequence[str] = (), nproc: int = 2, log_dir=None,
              timeout: float = 600, env: Optional[Mapping[str, str]] = None,
              master_port: Optional[int] = None, report_dir=None,
              failure_grace: float = FAILURE_GRACE_SECONDS) -> LaunchResult:
    """Run ``script args...`` on ``nproc`` local ranks under msrun and wait for all of them.

    ``log_dir`` (a new temp dir when None, kept afterwards) receives ``worker_<rank>.log``,
    ``scheduler.log`` and ``msrun.log``; ``report_dir`` (default ``log_dir``; old reports in it
    are removed) the rank reports. ``env`` is added to this process's environment.
    ``master_port`` is msrun's scheduler port; None picks a free one.
    Raises :class:`LaunchError` (with ``.result``) when a rank or msrun fails or ``timeout``
    seconds pass; the message names the failing rank, its exit code and its log tail. A failed
    rank ends the launch ``failure_grace`` seconds after it is seen, whatever the others do."""
    script = Path(script).resolve()
    if not script.is_file():
        raise InvalidArgumentError(f"script {str(script)!r} does not exist; pass a Python file")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise InvalidArgumentError(f"nproc must be an int >= 1, got {nproc!r}")
    if timeout <= 0:
        raise InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
    if failure_grace < 0:
        raise InvalidArgumentError(f"failure_grace must be >= 0 seconds, got {failure_grace!r}")
    log_dir = Path(log_dir) if log_dir is not None else Path(
        tempfile.mkdtemp(prefix="gradpool-msrun-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    report_dir = Path(report_dir) if report_dir is not None else log_dir
    report_dir.mkdir(parents=True, exist_ok=True)
    rank_report.remove_reports(report_dir)    # an old run's exit codes would end this one
    command = (*msrun_command(), f"--worker_num={nproc}", f"--local_worker_num={nproc}",
               f"--master_port={master_port or free_port()}", f"--log_dir={log_dir}", "--join=True",
               "python", "-m", _rank_entry.__name__, str(script), *map(str, args))
    worker_env = {**_worker_env(env), rank_report.ENV_DIR: str(report_dir)}
    result = _run(command, log_dir, report_dir, nproc, timeout, failure_grace, worker_env)
    if not result.ok:
        error = LaunchError(_failure_message(result))
        error.result = result
        raise error
    return result


def msrun_command() -> tuple[str, ...]:
    """msrun beside this interpreter (the virtualenv's), else the module it wraps."""
    beside = Path(sys.executable).parent / "msrun"
    if beside.is_file():
        return (str(beside),)
    return (sys.executable, "-m", "mindspore.parallel.cluster.run")


def free_port() -> int:
    """A TCP port free right now (the OS picks it for a bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- internals ---------------------------------------------------------------------------------
def _worker_env(extra: Optional[Mapping[str, str]]) -> dict[str, str]:
    env = dict(os.environ)
    # msrun starts ranks as "python ...", found on PATH: make that this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")    # prints reach the log before a crash or a kill
    env.update(extra or {})
    return env


def _run(command: tuple[str, ...], log_dir: Path, report_dir: Path, nproc: int, timeout: float,
         failure_grace: float, env: dict[str, str]) -> LaunchResult:
    logger.info("launching %d ranks: %s", nproc, " ".join(command))
    start = time.monotonic()
    timed_out = False
    stopped_for: Optional[int] = None
    failed_at = None
    with open(log_dir / "msrun.log", "w", encoding="utf-8") as out:
        # Own session: stopping it signals msrun's group, not the caller's.
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        while True:
            try:
                returncode: Optional[int] = proc.wait(timeout=POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if failed_at is None:
                dead = dead_rank(lambda: rank_report.read_reports(report_dir, nproc, results=False))
                if dead is not None:
                    failed_at = now
                    stopped_for = dead
                    # info, not warning: the LaunchError raised afterwards says it to the user
                    logger.info("rank %d failed; stopping the launch unless msrun ends "
                                "within %.0f s", dead, failure_grace)
            if now - start >= timeout or (failed_at is not None
                                          and now - failed_at >= failure_grace):
                timed_out = failed_at is None
                returncode = None
                _stop(proc, report_dir, nproc)
                break
    if returncode is not None:
        stopped_for = None        # msrun ended by itself: its own verdict and the codes stand
    seconds = time.monotonic() - start
    result = LaunchResult(command=command, log_dir=log_dir, returncode=returncode,
                          seconds=seconds, ranks=_collect(log_dir, report_dir, nproc, stopped_for),
                          timed_out=timed_out, report_dir=report_dir, stopped_for=stopped_for)
    logger.info("msrun returned %s after %.1f s; rank exit codes %s", returncode, seconds,
                result.exit_codes)
    return result


def dead_rank(read: Callable[[], Sequence[Optional[RankReport]]],
              alive: Callable[[int], bool] = None) -> Optional[int]:
    """The first rank that has failed, from the reports ``read()`` returns (one per rank, None
    for a rank that has not started): it recorded a non-zero exit code, or its process is gone
    without recording one. None when no rank has failed (yet)."""
    alive = alive or pid_alive
    reports = read()
    for report in reports:
        if report is None:
            continue
        if report.exit_code is not None:
            if report.exit_code != 0:
                return report.rank
        elif not alive(report.pid):
            # It may have recorded its exit and ended between the read and the pid check.
            fresh = read()[report.rank]
            if fresh is None or fresh.exit_code != 0:
                return report.rank
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by msrun, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):         # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _collect(log_dir: Path, report_dir: Path, nproc: int,
             stopped_for: Optional[int]) -> tuple[RankResult, ...]:
    msrun_codes = _msrun_failures(log_dir / "msrun.log")
    ranks = []
    for rank, report in enumerate(rank_report.read_reports(report_dir, nproc)):
        path = log_dir / f"worker_{rank}.log"
        pid = report.pid if report is not None else None
        code = report.exit_code if report is not None else None
        if pid is not None and pid in msrun_codes:
            code = msrun_codes[pid]
        ranks.append(RankResult(rank=rank, exit_code=code, pid=pid, log_path=path,
                                log_tail=_tail(path), report=report,
                                vanished=rank == stopped_for and code is None))
    return tuple(ranks)


def _msrun_failures(path: Path) -> dict[int, int]:
    return {int(m.group(1)): int(m.group(2))
            for m in map(_MSRUN_FAILURE.search, _lines(path)) if m}


def _lines(path: Path):
    if not path.is_file():
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        yield from f


def _tail(path: Path, lines: int = TAIL_LINES) -> str:
    return "".join(collections.deque(_lines(path), maxlen=lines))


def _stop(proc: subprocess.Popen, report_dir: Path, nproc: int) -> None:
    """Stop a launch (timed out, or a rank failed), and every rank it started."""
    # msrun's SIGINT handler kills its workers and scheduler.
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=_STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        proc.wait()
    # Workers run in their own sessions (msrun starts them with setsid): kill any left by pid,
    # also one that recorded its exit but hangs in it.
    for report in rank_report.read_reports(report_dir, nproc, results=False):
        if report is not None and pid_alive(report.pid):
            _kill_group(report.pid)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _failure_message(result: LaunchResult) -> str:
    if result.timed_out:
        head = f"msrun launch timed out after {result.seconds:.0f} s"
        shown = result.ranks
    elif result.failed_ranks:
        head = "; ".join(r.describe() for r in result.failed_ranks)
        shown = result.failed_ranks
    else:
        head = (f"msrun exited with code {result.returncode}; rank exit codes "
                f"{list(result.exit_codes)}")
        shown = tuple(r for r in result.ranks if r.exit_code != 0)
    if result.stopped_for is not None:
        head += (f". The launcher stopped msrun and the remaining ranks {result.seconds:.0f} s "
                 f"into the launch, after rank {result.stopped_for} failed")
    parts = [f"{head}. Logs in {result.log_dir}. Rank states: "
             + ", ".join(r.describe() for r in result.ranks)]
    for rank in shown:
        parts.append(f"--- {rank.log_path.name} (last {TAIL_LINES} lines) ---\n{rank.log_tail}")
    if not result.failed_ranks:     # the cause may be msrun's or the scheduler's
        for name in ("scheduler.log", "msrun.log"):
            parts.append(f"--- {name} (last {TAIL_LINES} lines) ---\n"
                         f"{_tail(result.log_dir / name)}")
    return "\n".join(parts)


# -- CLI ---------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradpool.launch",
                                     description="Run a script on N local CPU ranks via msrun.")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        result = run_ranks(ns.script, ns.args, nproc=ns.nproc, log_dir=ns.log_dir,
                           timeout=ns.timeout)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{ns.nproc} ranks exited 0 in {result.seconds:.1f} s; logs in {result.log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
