"""Watching one node's launch (:mod:`gradpool.app.launch` builds it): start its processes, follow
the ranks' reports, stop everything when a rank fails, the launch times out or a stop signal
arrives, and say how each rank ended.

While the ranks run, the launcher polls the reports (this node's, and on a shared filesystem the
other nodes' ``node<k>/`` directories, read only). Once a rank has exited non-zero, or its
process is gone without an exit record, the launch gets ``failure_grace`` seconds to end by
itself; after that the launcher stops msrun and every rank and raises. msrun alone can take much
longer: it sees a rank only when the rank's process ends (a non-daemon thread can keep a failed
rank's process alive), and after killing the other workers it waits for MindSpore's scheduler,
which waits out the dead node's heartbeat timeout.

SIGTERM, SIGHUP and SIGINT to the launcher stop msrun and every rank too (:mod:`gradpool.app.lifeline`:
msrun and the ranks run in sessions of their own, so the signal reaches only the launcher), once
a save in progress has finished and committed, or ``train.stop_save_grace_s`` has passed; the
launch then ends with :class:`~gradpool.app.lifeline.LaunchInterrupted` (status 128 + the
signal) after one logged line naming what was stopped and the last committed checkpoint.
"""
from __future__ import annotations

import collections
import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from gradpool.app import lifeline, rank_report
from gradpool.app.checkpoints import LAST_CHECKPOINT, SAVE_IN_FLIGHT
from gradpool.app.lifeline import LaunchInterrupted
from gradpool.app.rank_report import RankReport
from gradpool.errors import InvalidArgumentError

# ``launch`` below is a gradpool.app.launch.NodeLaunch, not imported: launch imports this module.

logger = logging.getLogger("gradpool.launch")   # one logger for the launch, whichever module

TAIL_LINES = 60
# msrun (process_entity/_api.py) logs this for the first worker that exits non-zero.
_MSRUN_FAILURE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
_STOP_GRACE_SECONDS = 20.0
# after SIGTERM/SIGHUP/SIGINT: how long msrun gets to end its workers before the launcher kills
# its process group (every process of the launch must be gone within 10 s of the signal)
_INTERRUPT_GRACE_SECONDS = 4.0
POLL_SECONDS = 0.5
# Another node's report counts for this launch only if it started at most this long before this
# node did (a shared log_dir may still hold an earlier run's reports; clocks of one cluster
# agree to far better than this).
PEER_REPORT_SLACK_SECONDS = 10.0


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
    node: Optional[int] = None              # set for a rank of another node

    def describe(self) -> str:
        if self.node is not None:
            code = "no exit recorded" if self.exit_code is None else \
                f"exit code {self.exit_code}"
            return f"rank {self.rank} (node {self.node}): {code}"
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
    # msrun's own; 0 when every rank ended with 0 and the launcher ended msrun (see _run); None
    # when the launcher stopped it otherwise
    returncode: Optional[int]
    seconds: float
    ranks: tuple[RankResult, ...]
    timed_out: bool = False
    report_dir: Optional[Path] = None
    stopped_for: Optional[int] = None     # the failed rank the launcher stopped the launch for
    peer_ranks: tuple = ()                # another node's failed rank (shared filesystem)
    node_rank: int = 0

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



def _worker_env(extra) -> dict[str, str]:
    env = dict(os.environ)
    # msrun starts ranks as "python ...", found on PATH: make that this interpreter.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")    # prints reach the log before a crash or a kill
    env.update(dict(extra or {}))
    # every process of the launch watches this one, and ends when it is gone (lifeline)
    env.pop(lifeline.LAUNCHER_ENV, None)
    identity = lifeline.launcher_identity()
    if identity is not None:
        env[lifeline.LAUNCHER_ENV] = identity
    return env


@dataclass
class _Watch:
    """The reports a launch watches: this node's ranks, and readable peers' (fresh ones only)."""

    launch: Any
    peers: dict
    since: float = field(default_factory=time.time)
    stopped_for: Optional[int] = None     # the failed rank the launch is being stopped for

    def local(self, results: bool = False) -> list:
        return rank_report.read_ranks(self.launch.report_dir, self.launch.spec.ranks, results)

    def peer_reports(self) -> list:
        out = []
        for node, directory in self.peers.items():
            ranks = range(node * self.launch.spec.local, (node + 1) * self.launch.spec.local)
            try:
                reports = rank_report.read_ranks(directory, ranks, results=False)
            except InvalidArgumentError:
                continue        # not ours to judge: another program's file
            out += [r if r is not None and r.started >= self.since - PEER_REPORT_SLACK_SECONDS
                    else None for r in reports]
        return out

    def all_ended_well(self) -> bool:
        """Every rank of this node recorded exit code 0 and its process is gone."""
        return all(r is not None and r.exit_code == 0 and not pid_alive(r.pid)
                   for r in self.local())

    def dead(self) -> Optional[int]:
        found = dead_rank(self.local)
        if found is not None or not self.peers:
            return found
        # a peer's pid lives on another host: only its recorded exit code says it failed
        return dead_rank(self.peer_reports, alive=lambda pid: True)


_TIMED_OUT, _STOPPED = "timed out", "stopped"      # _supervise's outcomes besides a code


def _run(launch, timeout: float, failure_grace: float, peers: dict,
         stop_save_grace: float = 0.0) -> LaunchResult:
    logger.info("launching ranks %s: %s", list(launch.spec.ranks),
                " ".join(launch.command))
    watch = _Watch(launch, peers)
    start = time.monotonic()
    procs: list = []
    signals = lifeline.StopSignals()
    try:
        with signals:
            returncode = _supervise(launch, procs, watch, signals, timeout, failure_grace,
                                    stop_save_grace)
    except BaseException:
        _stop(procs, launch, via_msrun=launch.via_msrun)     # leave nothing running
        raise
    if signals.signum is not None:
        raise _interrupted(launch, procs, signals.signum)
    timed_out = returncode == _TIMED_OUT
    if returncode in (_TIMED_OUT, _STOPPED):
        returncode = None
    stopped_for = watch.stopped_for
    if returncode is not None and launch.via_msrun:
        stopped_for = None        # msrun ended by itself: its own verdict and the codes stand
    seconds = time.monotonic() - start
    codes = {p.rank: proc.returncode for p, proc in zip(launch.processes, procs)
             if p.rank is not None}
    ranks = _collect(launch, stopped_for, codes)
    peer_failed = tuple(_peer_results(watch, stopped_for)) if stopped_for is not None and \
        stopped_for not in launch.spec.ranks else ()
    result = LaunchResult(command=launch.command, log_dir=launch.log_dir, returncode=returncode,
                          seconds=seconds, ranks=ranks, timed_out=timed_out,
                          report_dir=launch.report_dir, stopped_for=stopped_for,
                          peer_ranks=peer_failed, node_rank=launch.spec.node_rank)
    logger.info("launch returned %s after %.1f s; rank exit codes %s", returncode, seconds,
                result.exit_codes)
    return result


def _supervise(launch, procs: list, watch: "_Watch", signals, timeout: float,
               failure_grace: float, stop_save_grace: float = 0.0):
    """Start the launch's processes into ``procs`` and watch them until they end (their return
    code), a rank fails and the grace passes or the launch times out (stopped: ``_STOPPED``,
    ``_TIMED_OUT``), or a stop signal arrives (stopped, ``signals.signum`` set, after a save in
    progress had up to ``stop_save_grace`` seconds to commit)."""
    start = time.monotonic()
    failed_at = None
    # Once every rank of a one-node job has ended well, the launcher ends msrun, whose scheduler
    # notices that only at its next check (every 5 s: docs/launch.md#when-a-launch-ends). Not on
    # a multi-node job: node 0's msrun runs the scheduler the other nodes' ranks still need.
    may_end_early = launch.via_msrun and launch.spec.nodes == 1
    for process in launch.processes:
        if signals.signum is not None:
            break
        with open(launch.log_dir / process.log_name, "w", encoding="utf-8") as out:
            # Own session: stopping it signals its group, not the caller's (msrun starts
            # its workers with setsid as well).
            procs.append(subprocess.Popen(process.argv, stdout=out, stderr=subprocess.STDOUT,
                                          env=_worker_env(process.env),
                                          start_new_session=True))
    while True:
        if signals.signum is not None:
            _let_save_commit(launch, procs, signals.signum, stop_save_grace)
            _stop(procs, launch, via_msrun=launch.via_msrun, grace=_INTERRUPT_GRACE_SECONDS)
            return _STOPPED
        if _all_ended(procs, POLL_SECONDS):
            return _returncode(procs)
        now = time.monotonic()
        if failed_at is None:
            dead = watch.dead()
            if dead is not None:
                failed_at = now
                watch.stopped_for = dead
                # info, not warning: the LaunchError raised afterwards says it to the user
                logger.info("rank %d failed; stopping the launch unless it ends within %.0f s",
                            dead, failure_grace)
        if may_end_early and watch.all_ended_well():
            logger.info("every rank ended with exit code 0; ending msrun's scheduler")
            _stop(procs, launch, via_msrun=True)
            # the ranks' verdict: msrun's own status is now that of the signal (or of its
            # own exit, when it was ending just then)
            return 0
        if now - start >= timeout:
            _stop(procs, launch, via_msrun=launch.via_msrun)
            return _TIMED_OUT if failed_at is None else _STOPPED
        if failed_at is not None and now - failed_at >= failure_grace:
            _stop(procs, launch, via_msrun=launch.via_msrun)
            return _STOPPED


def _interrupted(launch, procs: list, signum: int) -> LaunchInterrupted:
    """The one line a stop signal ends the launch with (logged as a warning: the CLI shows it)."""
    name = signal.Signals(signum).name
    ranks = ", ".join(str(r) for r in launch.spec.ranks)
    what = (f"msrun (pid {procs[0].pid}) and rank(s) {ranks}" if launch.via_msrun and procs
            else f"rank(s) {ranks}")
    left = [r.pid for r in rank_report.read_ranks(launch.report_dir, launch.spec.ranks,
                                                  results=False)
            if r is not None and still_ours(r)]
    where = f"; processes still ending: {left}" if left else ", no process of the launch left"
    message = (f"{name}: stopped {what}{where}; last committed checkpoint: "
               f"{_last_checkpoint(launch)}; logs in {launch.log_dir}")
    logger.warning("%s", message)
    return LaunchInterrupted(signum, message)


def _saves_in_flight(launch) -> dict[int, int]:
    """``{rank: step}`` of this node's running ranks that have a save started and not committed
    (rank_main publishes it: ``checkpoints.SAVE_IN_FLIGHT``)."""
    found = {}
    for report in rank_report.read_ranks(launch.report_dir, launch.spec.ranks):
        if report is None or report.exit_code is not None or not still_ours(report):
            continue
        saving = (report.results or {}).get(SAVE_IN_FLIGHT)
        if isinstance(saving, dict):
            found[report.rank] = saving["step"]
    return found


def _let_save_commit(launch, procs: list, signum: int, grace: float) -> None:
    """A stop signal came. If a rank of this node has a save in progress, give it up to
    ``grace`` seconds to finish and commit (a background save commits at the end of the first
    step after every rank's write finished; the ranks train on meanwhile, and a save they start
    later is not waited for), saying so; then the caller stops every rank."""
    in_flight = _saves_in_flight(launch) if grace > 0 else {}
    if not in_flight:
        return
    name, step = signal.Signals(signum).name, max(in_flight.values())
    logger.warning("%s: letting the save of step %d finish and commit before stopping the ranks "
                   "(up to %.0f s: train.stop_save_grace_s)", name, step, grace)
    start = time.monotonic()
    while time.monotonic() - start < grace:
        if all(saved > step for saved in _saves_in_flight(launch).values()):
            logger.warning("%s: the save of step %d committed after %.1f s", name, step,
                           time.monotonic() - start)
            return
        if _all_ended(procs, 0.2):
            return
    logger.warning("%s: the save of step %d did not commit within %.0f s "
                   "(train.stop_save_grace_s); it stays uncommitted", name, step, grace)


def _last_checkpoint(launch) -> str:
    """The newest checkpoint a rank of this node reported committed (rank_main publishes it)."""
    newest = None
    for report in rank_report.read_ranks(launch.report_dir, launch.spec.ranks):
        saved = (report.results or {}).get(LAST_CHECKPOINT) if report is not None else None
        if isinstance(saved, dict) and (newest is None or saved["step"] > newest["step"]):
            newest = saved
    return "none" if newest is None else f"{newest['path']} (step {newest['step']})"


def _all_ended(procs: list, wait: float) -> bool:
    deadline = time.monotonic() + wait
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def _returncode(procs: list) -> int:
    """msrun's own code; for workers started directly, the first non-zero one (else 0)."""
    return next((p.returncode for p in procs if p.returncode != 0), 0)


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
            fresh = next((r for r in read() if r is not None and r.rank == report.rank), None)
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


def _collect(launch, stopped_for: Optional[int],
             codes: Mapping[int, Optional[int]]) -> tuple[RankResult, ...]:
    """This node's ranks: the report's exit code, unless msrun's log or the worker process
    (started directly) knows the process's real status."""
    msrun_codes = _msrun_failures(launch.log_dir / "msrun.log") if launch.via_msrun else {}
    ranks = []
    reports = rank_report.read_ranks(launch.report_dir, launch.spec.ranks)
    for rank, report in zip(launch.spec.ranks, reports):
        path = launch.log_dir / f"worker_{rank}.log"
        pid = report.pid if report is not None else None
        code = report.exit_code if report is not None else None
        if pid is not None and pid in msrun_codes:
            code = msrun_codes[pid]
        if stopped_for is None and codes.get(rank) not in (None, 0):
            # a direct worker that ended by itself: its real status (a signal, a crash after
            # the script); once the launcher stops a launch, the signals are its own
            code = codes[rank]
        ranks.append(RankResult(rank=rank, exit_code=code, pid=pid, log_path=path,
                                log_tail=_tail(path), report=report,
                                vanished=rank == stopped_for and code is None))
    return tuple(ranks)


def _peer_results(watch: _Watch, rank: int) -> list:
    """The failed rank of another node, with its log tail when its directory is readable."""
    node = rank // watch.launch.spec.local
    directory = watch.peers.get(node)
    if directory is None:
        return []
    report = rank_report.read_report(directory, rank, results=False)
    path = Path(directory) / f"worker_{rank}.log"
    return [RankResult(rank=rank, exit_code=report.exit_code if report else None,
                       pid=report.pid if report else None, log_path=path, log_tail=_tail(path),
                       report=report, node=node)]


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


def _stop(procs: list, launch, via_msrun: bool,
          grace: float = _STOP_GRACE_SECONDS) -> None:
    """Stop a launch (timed out, a rank failed, interrupted), and every rank it started; msrun
    gets ``grace`` seconds to stop its workers before its process group is killed."""
    for proc in procs:
        if proc.poll() is not None:
            continue
        # msrun's SIGINT handler kills its workers and scheduler; a direct worker just ends
        proc.send_signal(signal.SIGINT if via_msrun else signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            # our child, not reaped yet: its pid cannot have been given to another process
            _kill_group(proc.pid)
            proc.wait()
    # Workers run in their own sessions (msrun starts them with setsid): kill any left by pid,
    # also one that recorded its exit but hangs in it; only while the pid is still the rank's.
    for report in rank_report.read_ranks(launch.report_dir, launch.spec.ranks, results=False):
        if report is not None:
            kill_rank(report)


def still_ours(report: RankReport) -> bool:
    """Whether ``report``'s pid is still the rank's process: alive, and started when the rank
    said it did (``pid_start``, as :mod:`~gradpool.app.lifeline` checks the launcher). A rank
    that died may have its pid reused by an unrelated process; a report without a start time
    cannot prove it, so it is not ours to kill."""
    if report.pid_start is None:
        return False
    return lifeline.process_start(report.pid) == report.pid_start


def kill_rank(report: RankReport) -> bool:
    """Kill the process group of ``report``'s rank if its pid is :func:`still_ours`; whether it
    was signalled. (The start time is read just before the kill: a pid is reused only after the
    kernel has handed out every other one, far longer than that gap.)"""
    if not still_ours(report):
        if report.pid_start is None and pid_alive(report.pid):
            logger.warning("rank %d: process %d is alive, but its report has no start time to "
                           "tell it from another process that got its pid; not killed",
                           report.rank, report.pid)
        return False
    _kill_group(report.pid)
    return True


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _failure_message(result: LaunchResult) -> str:
    if result.timed_out:
        head = f"msrun launch timed out after {result.seconds:.0f} s"
        shown = result.ranks
    elif result.failed_ranks or result.peer_ranks:
        head = "; ".join(r.describe() for r in result.peer_ranks + result.failed_ranks)
        shown = result.peer_ranks + result.failed_ranks
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
    if not result.failed_ranks and not result.peer_ranks:   # msrun's or the scheduler's
        for name in ("scheduler.log", "msrun.log"):
            parts.append(f"--- {name} (last {TAIL_LINES} lines) ---\n"
                         f"{_tail(result.log_dir / name)}")
    return "\n".join(parts)

