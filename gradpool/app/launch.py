"""Start this node's ranks with MindSpore's own launcher, ``msrun``, and watch them.

``run_ranks`` runs a script on N ranks of this host::

    msrun --worker_num=N --local_worker_num=N --master_port=PORT --log_dir=DIR --join=True \\
          --cluster_time_out=600 python -m gradpool.app._rank_entry SCRIPT ARGS...

``run_node`` runs one node of a multi-node job (:func:`build_node_launch` builds it, and
``gradpool launch-cmd`` prints it)::

    msrun --worker_num=WORLD --local_worker_num=L --master_port=PORT --master_addr=ADDR \\
          --node_rank=K --log_dir=DIR --join=True --cluster_time_out=T python -m ...

Both report every rank's exit code and log tail. ``_rank_entry`` runs SCRIPT unchanged; it only
writes the rank's report (:mod:`gradpool.app.rank_report`, in ``report_dir``, which the ranks
find in ``$GRADPOOL_RANK_REPORT_DIR``): rank and pid at the start, the exit code at the end, as
msrun itself names only the pid of the first worker that failed. msrun's own "Worker process PID
exit with exception. Error code: N" line still wins for that pid: it is the real process status
(a crash after the script ended, a signal).

While the ranks run, the launcher polls the reports (this node's, and on a shared filesystem the
other nodes' ``node<k>/`` directories, read only). Once a rank has exited non-zero, or its
process is gone without an exit record, the launch gets ``failure_grace`` seconds to end by
itself; after that the launcher stops msrun and every rank and raises. msrun alone can take much
longer: it sees a rank only when the rank's process ends (a non-daemon thread can keep a failed
rank's process alive), and after killing the other workers it waits for MindSpore's scheduler,
which waits out the dead node's heartbeat timeout.

One host as several nodes (tests, rehearsals): msrun decides "this node is the master, start
the scheduler" from whether ``--master_addr`` is an address of this host, not from
``--node_rank``; a second msrun on the master's host would start a second scheduler, which fails
on the taken port and makes that msrun exit 1 although its workers succeeded (measured,
MindSpore 2.10). So for a node with ``node_rank != 0`` whose master address is local, the
launcher starts the node's workers itself, each with the environment msrun would give it
(MindSpore's documented dynamic-cluster variables ``MS_ROLE=MS_WORKER``, ``MS_SCHED_HOST``,
``MS_SCHED_PORT``, ``MS_WORKER_NUM``, ``MS_NODE_ID``, ``MS_TOPO_TIMEOUT``, plus the ``RANK_ID``,
``RANK_SIZE`` and ``DEVICE_ID`` msrun exports) and its log in ``worker_<rank>.log``. On a real
cluster every node's master address is remote but node 0's, so msrun launches every node.

Facts this relies on (MindSpore 2.10, measured): msrun runs ``python`` from ``PATH`` (so this
interpreter's directory goes first on the workers' ``PATH``); it writes ``worker_<rank>.log``
and ``scheduler.log`` into ``--log_dir``; the scheduler process runs the same command with
``MS_ROLE=MS_SCHED`` (it serves the cluster from inside ``communication.init()``); a 2-rank launch
costs ~14 s on 2 cores, ~6 s of it import and init, so run many cases per launch.

CLI: ``python -m gradpool.app.launch --nproc 2 script.py ARGS...``.
"""
from __future__ import annotations

import argparse
import collections
import ipaddress
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from gradpool.app import _rank_entry, lifeline, rank_report
from gradpool.app.lifeline import LaunchInterrupted
from gradpool.app.config import DEFAULT_CLUSTER_TIMEOUT_S
from gradpool.app.rank_report import RankReport
from gradpool.errors import InvalidArgumentError
from gradpool.app.errors import ConfigValueError, LaunchError

logger = logging.getLogger("gradpool.launch")   # also when run as __main__

TAIL_LINES = 60
# msrun (process_entity/_api.py) logs this for the first worker that exits non-zero.
_MSRUN_FAILURE = re.compile(r"Worker process (\d+) exit with exception\. Error code: (-?\d+)")
_STOP_GRACE_SECONDS = 20.0
# after SIGTERM/SIGHUP/SIGINT: how long msrun gets to end its workers before the launcher kills
# its process group (every process of the launch must be gone within 10 s of the signal)
_INTERRUPT_GRACE_SECONDS = 4.0
POLL_SECONDS = 0.5
FAILURE_GRACE_SECONDS = 5.0     # after a rank failed, how long msrun may take to end by itself
# Another node's report counts for this launch only if it started at most this long before this
# node did (a shared log_dir may still hold an earlier run's reports; clocks of one cluster
# agree to far better than this).
PEER_REPORT_SLACK_SECONDS = 10.0
MIN_MASTER_PORT = 1024          # msrun: "port numbers within the range of 1024 to 65535"


# -- what one node starts ----------------------------------------------------------------------
@dataclass(frozen=True)
class NodeSpec:
    """One node of a job: ``world`` ranks in all (msrun's ``worker_num``), ``local`` of them
    here (``local_worker_num``), global ranks ``node_rank * local`` to ``+ local - 1``."""

    world: int
    local: int
    node_rank: int = 0
    nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    cluster_timeout_s: int = DEFAULT_CLUSTER_TIMEOUT_S

    def __post_init__(self) -> None:
        for name in ("world", "local", "nodes", "cluster_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"NodeSpec.{name} must be an int >= 1, got {value!r}")
        if self.local * self.nodes != self.world:
            raise InvalidArgumentError(
                f"NodeSpec: {self.nodes} node(s) x {self.local} local rank(s) is not the world "
                f"size {self.world}; every node runs world / nodes ranks")
        if not isinstance(self.node_rank, int) or not 0 <= self.node_rank < self.nodes:
            raise InvalidArgumentError(f"NodeSpec.node_rank must be in [0, {self.nodes}), got "
                                       f"{self.node_rank!r}")

    @property
    def ranks(self) -> range:
        return range(self.node_rank * self.local, (self.node_rank + 1) * self.local)


@dataclass(frozen=True)
class Process:
    """One process the launcher starts: ``argv``, what it adds to the environment, and the file
    in the log directory that takes its output."""

    argv: tuple
    env: tuple                   # (name, value) pairs added to the launching environment
    log_name: str
    rank: Optional[int] = None   # a worker started directly; None for msrun


@dataclass(frozen=True)
class NodeLaunch:
    spec: NodeSpec
    log_dir: Path
    report_dir: Path
    processes: tuple
    via_msrun: bool              # False: this node's workers started directly (see module doc)

    @property
    def command(self) -> tuple:
        return self.processes[0].argv

    def shell(self) -> str:
        """The environment and commands, as a shell would run them (``gradpool launch-cmd``)."""
        common = dict(self.processes[0].env) if self.via_msrun else dict(
            set.intersection(*(set(p.env) for p in self.processes)))
        lines = [f"# node {self.spec.node_rank} of {self.spec.nodes}: ranks "
                 f"{self.spec.ranks.start}-{self.spec.ranks.stop - 1} of {self.spec.world}"]
        if not self.via_msrun:
            lines.append("# master_addr is this host's and node_rank != 0: the workers start "
                         "without msrun (msrun would start a second scheduler)")
        lines.append(f"export PATH={shlex.quote(str(Path(sys.executable).parent))}:\"$PATH\"")
        lines += [f"export {name}={shlex.quote(value)}" for name, value in sorted(common.items())]
        for process in self.processes:
            own = [f"{n}={shlex.quote(v)}" for n, v in process.env if n not in common]
            redirect = "" if self.via_msrun else \
                f" > {shlex.quote(str(self.log_dir / process.log_name))} 2>&1 &"
            lines.append(" ".join(own + [shlex.join(process.argv)]) + redirect)
        if not self.via_msrun:
            lines.append("wait")
        return "\n".join(lines)


def build_node_launch(spec: NodeSpec, script, args: Sequence[str] = (), *, log_dir,
                      report_dir=None, env: Optional[Mapping[str, str]] = None,
                      master_is_local: Optional[bool] = None) -> NodeLaunch:
    """What this node starts for ``spec``: msrun, or (``node_rank != 0`` with a master address
    of this host, ``master_is_local``; None asks the network) the workers themselves.
    ``env`` is added to every rank's environment (the rank report directory too)."""
    log_dir = Path(log_dir)
    report_dir = Path(report_dir) if report_dir is not None else log_dir
    common = {**dict(env or {}), rank_report.ENV_DIR: str(report_dir),
              "PYTHONUNBUFFERED": "1"}
    entry = ("-m", _rank_entry.__name__, str(script), *map(str, args))
    direct = spec.nodes > 1 and spec.node_rank != 0 and (
        is_local_address(spec.master_addr) if master_is_local is None else master_is_local)
    if not direct:
        multi = ((f"--master_addr={spec.master_addr}", f"--node_rank={spec.node_rank}")
                 if spec.nodes > 1 else ())
        argv = (*msrun_command(), f"--worker_num={spec.world}", f"--local_worker_num={spec.local}",
                f"--master_port={spec.master_port}", *multi, f"--log_dir={log_dir}",
                "--join=True", f"--cluster_time_out={spec.cluster_timeout_s}", "python", *entry)
        process = Process(argv=argv, env=tuple(sorted(common.items())), log_name="msrun.log")
        return NodeLaunch(spec, log_dir, report_dir, (process,), via_msrun=True)
    workers = []
    for local, rank in enumerate(spec.ranks):
        own = {"MS_ROLE": "MS_WORKER", "MS_SCHED_HOST": spec.master_addr,
               "MS_SCHED_PORT": str(spec.master_port), "MS_WORKER_NUM": str(spec.world),
               "MS_NODE_ID": str(rank), "MS_TOPO_TIMEOUT": str(spec.cluster_timeout_s),
               "RANK_ID": str(rank), "RANK_SIZE": str(spec.world), "DEVICE_ID": str(local)}
        workers.append(Process(argv=(sys.executable, *entry),
                               env=tuple(sorted({**common, **own}.items())),
                               log_name=f"worker_{rank}.log", rank=rank))
    return NodeLaunch(spec, log_dir, report_dir, tuple(workers), via_msrun=False)


def is_local_address(addr: str) -> bool:
    """Whether msrun would call ``addr`` this host's (and so start a scheduler here)."""
    try:
        # msrun's own decision (private to MindSpore, hence guarded): the same answer it gives
        from mindspore.parallel.cluster.process_entity._utils import (_convert_addr_to_ip,
                                                                      _is_local_ip)
        return bool(_is_local_ip(_convert_addr_to_ip(addr)))
    except ImportError:
        pass
    except Exception:  # noqa: BLE001 - e.g. a name that does not resolve: not local
        return False
    try:                # an address a socket can bind to belongs to this host
        infos = socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, _, _, _, sockaddr in infos:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((sockaddr[0], 0))
                return True
            except OSError:
                continue
    return False


def check_launch(launch, master_is_local: Optional[bool] = None) -> None:
    """Refuse, before anything starts, what would only fail later: a privileged port, a master
    host name that does not resolve, a node 0 whose master address is not its own, a scheduler
    port already in use here. ``launch`` is a :class:`gradpool.app.config.LaunchConfig`;
    raises :class:`ConfigValueError` naming the key and value."""
    port, addr = launch.master_port, launch.master_addr
    if port is not None and port < MIN_MASTER_PORT:
        raise ConfigValueError(
            f"launch.master_port = {port} is below {MIN_MASTER_PORT}: msrun's scheduler takes a "
            "port in [1024, 65535] (lower ones are privileged); pick another or null",
            key="launch.master_port", given=port, allowed="an integer in [1024, 65535] or null")
    if launch.nodes > 1:
        try:
            ipaddress.ip_address(addr.strip("[]"))
        except ValueError:
            try:
                socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
            except OSError as exc:
                raise ConfigValueError(
                    f"launch.master_addr = {addr!r} does not resolve on this host ({exc}); give "
                    "node 0's IP address or a host name every node resolves",
                    key="launch.master_addr", given=addr, allowed="a resolvable host") from None
    local = is_local_address(addr) if master_is_local is None and launch.nodes > 1 \
        else master_is_local
    if launch.nodes > 1 and launch.node_rank == 0 and not local:
        raise ConfigValueError(
            f"launch.master_addr = {addr!r} is not an address of this host, but node_rank 0 runs "
            "msrun's scheduler there: run node 0 on that host, or set master_addr to this host's "
            "address", key="launch.master_addr", given=addr, allowed="an address of node 0")
    if port is not None and (launch.nodes == 1 or launch.node_rank == 0) and not port_free(
            port, addr if launch.nodes > 1 else "127.0.0.1"):
        raise ConfigValueError(
            f"launch.master_port = {port} is in use on this host (the scheduler could not "
            "listen on it); pick a free port, or null to let the launcher pick one",
            key="launch.master_port", given=port, allowed="a free port in [1024, 65535] or null")


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a listening socket could take ``host:port`` now (TIME_WAIT leftovers do not
    count: the scheduler reuses addresses too)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        infos = [(socket.AF_INET, None, None, None, ("127.0.0.1", port))]
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(sockaddr)
            sock.listen(1)
            return True
        except OSError:
            return False


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
    script = _check_script(script)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise InvalidArgumentError(f"nproc must be an int >= 1, got {nproc!r}")
    _check_times(timeout, failure_grace)
    log_dir = Path(log_dir) if log_dir is not None else Path(
        tempfile.mkdtemp(prefix="gradpool-msrun-"))
    spec = NodeSpec(world=nproc, local=nproc, master_port=master_port or free_port())
    launch = build_node_launch(spec, script, args, log_dir=log_dir, report_dir=report_dir,
                               env=env)
    return run_node(launch, timeout=timeout, failure_grace=failure_grace)


def run_node(launch: NodeLaunch, timeout: float = 600,
             failure_grace: float = FAILURE_GRACE_SECONDS,
             peer_dirs: Mapping[int, Path] = None) -> LaunchResult:
    """Start ``launch`` (one node's msrun, or its workers) and wait for this node's ranks.

    ``peer_dirs`` maps other nodes to the directories their ranks report into, when this node
    can read them (a shared filesystem): a rank failing there ends this launch too, and its log
    tail is in the error. Raises :class:`LaunchError` like :func:`run_ranks`."""
    _check_times(timeout, failure_grace)
    launch.log_dir.mkdir(parents=True, exist_ok=True)
    launch.report_dir.mkdir(parents=True, exist_ok=True)
    rank_report.remove_reports(launch.report_dir)   # an old run's exit codes would end this one
    result = _run(launch, timeout, failure_grace, dict(peer_dirs or {}))
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
def _check_script(script) -> Path:
    script = Path(script).resolve()
    if not script.is_file():
        raise InvalidArgumentError(f"script {str(script)!r} does not exist; pass a Python file")
    return script


def _check_times(timeout: float, failure_grace: float) -> None:
    if timeout <= 0:
        raise InvalidArgumentError(f"timeout must be > 0 seconds, got {timeout!r}")
    if failure_grace < 0:
        raise InvalidArgumentError(f"failure_grace must be >= 0 seconds, got {failure_grace!r}")


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

    launch: NodeLaunch
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


def _run(launch: NodeLaunch, timeout: float, failure_grace: float, peers: dict) -> LaunchResult:
    logger.info("launching ranks %s: %s", list(launch.spec.ranks),
                " ".join(launch.command))
    watch = _Watch(launch, peers)
    start = time.monotonic()
    procs: list = []
    signals = lifeline.StopSignals()
    try:
        with signals:
            returncode = _supervise(launch, procs, watch, signals, timeout, failure_grace)
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


def _supervise(launch: NodeLaunch, procs: list, watch: "_Watch", signals, timeout: float,
               failure_grace: float):
    """Start the launch's processes into ``procs`` and watch them until they end (their return
    code), a rank fails and the grace passes or the launch times out (stopped: ``_STOPPED``,
    ``_TIMED_OUT``), or a stop signal arrives (stopped, ``signals.signum`` set)."""
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


def _interrupted(launch: NodeLaunch, procs: list, signum: int) -> LaunchInterrupted:
    """The one line a stop signal ends the launch with (logged as a warning: the CLI shows it)."""
    name = signal.Signals(signum).name
    ranks = ", ".join(str(r) for r in launch.spec.ranks)
    what = (f"msrun (pid {procs[0].pid}) and rank(s) {ranks}" if launch.via_msrun and procs
            else f"rank(s) {ranks}")
    left = [r.pid for r in rank_report.read_ranks(launch.report_dir, launch.spec.ranks,
                                                  results=False)
            if r is not None and pid_alive(r.pid)]
    where = f"; processes still ending: {left}" if left else ", no process of the launch left"
    message = (f"{name}: stopped {what}{where}; last committed checkpoint: "
               f"{_last_checkpoint(launch)}; logs in {launch.log_dir}")
    logger.warning("%s", message)
    return LaunchInterrupted(signum, message)


def _last_checkpoint(launch: NodeLaunch) -> str:
    """The newest checkpoint a rank of this node reported committed (rank_main publishes it)."""
    from gradpool.app.checkpoints import LAST_CHECKPOINT
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


def _collect(launch: NodeLaunch, stopped_for: Optional[int],
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


def _stop(procs: list, launch: NodeLaunch, via_msrun: bool,
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
            _kill_group(proc.pid)
            proc.wait()
    # Workers run in their own sessions (msrun starts them with setsid): kill any left by pid,
    # also one that recorded its exit but hangs in it.
    for report in rank_report.read_ranks(launch.report_dir, launch.spec.ranks, results=False):
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
