"""Start this node's ranks with MindSpore's own launcher, ``msrun``, and watch them.

``run_ranks`` runs a script on N ranks of this host::

    msrun --worker_num=N --local_worker_num=N --master_port=PORT --log_dir=DIR --join=True \\
          --cluster_time_out=600 python -m gradpool.app._rank_entry SCRIPT ARGS...

``run_node`` runs one node of a multi-node job (:func:`build_node_launch` builds it, and
``gradpool launch-cmd`` prints it)::

    msrun --worker_num=WORLD --local_worker_num=L --master_port=PORT --master_addr=ADDR \\
          --node_rank=K --log_dir=DIR --join=True --cluster_time_out=T python -m ...

Both report every rank's exit code and log tail (:mod:`gradpool.app.supervise` watches the
launch, and stops it on a failure, a timeout or a signal). ``_rank_entry`` runs SCRIPT unchanged; it only
writes the rank's report (:mod:`gradpool.app.rank_report`, in ``report_dir``, which the ranks
find in ``$GRADPOOL_RANK_REPORT_DIR``): rank and pid at the start, the exit code at the end, as
msrun itself names only the pid of the first worker that failed. msrun's own "Worker process PID
exit with exception. Error code: N" line still wins for that pid: it is the real process status
(a crash after the script ended, a signal).

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
import ipaddress
import logging
import shlex
import socket
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from gradpool.app import _rank_entry, rank_report
from gradpool.app.config import DEFAULT_CLUSTER_TIMEOUT_S
from gradpool.app.errors import ConfigValueError, LaunchError
from gradpool.errors import InvalidArgumentError
# Watching a launch lives in supervise; its public names stay importable from here.
from gradpool.app.supervise import (POLL_SECONDS, TAIL_LINES, LaunchInterrupted,  # noqa: F401
                                    LaunchResult, RankResult, _failure_message, _run, _Watch,
                                    dead_rank, pid_alive)

logger = logging.getLogger("gradpool.launch")   # also when run as __main__

FAILURE_GRACE_SECONDS = 5.0     # after a rank failed, how long msrun may take to end by itself
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
             peer_dirs: Mapping[int, Path] = None, stop_save_grace: float = 0.0) -> LaunchResult:
    """Start ``launch`` (one node's msrun, or its workers) and wait for this node's ranks.

    ``peer_dirs`` maps other nodes to the directories their ranks report into, when this node
    can read them (a shared filesystem): a rank failing there ends this launch too, and its log
    tail is in the error. ``stop_save_grace``: on a stop signal, the seconds a save in progress
    gets to commit before the ranks are stopped. Raises :class:`LaunchError` like
    :func:`run_ranks`."""
    _check_times(timeout, failure_grace)
    launch.log_dir.mkdir(parents=True, exist_ok=True)
    launch.report_dir.mkdir(parents=True, exist_ok=True)
    rank_report.remove_reports(launch.report_dir)   # an old run's exit codes would end this one
    result = _run(launch, timeout, failure_grace, dict(peer_dirs or {}), stop_save_grace)
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
