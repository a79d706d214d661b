"""The one way a rank's results reach the process that launched it: a JSON "rank report".

Each rank owns one file, ``<dir>/rank<R>.report.json``, holding a :class:`RankReport`: who the
rank is (rank, world size, pid, ``MS_ROLE``), how its process is doing (``running``, then
``exited`` with an exit code) and a ``results`` dict that belongs to the program (the test
harness's case results, ``gradpool train``'s step records and outcome, benchmark rows).

The rank rewrites the file whenever something changes, through a temporary file and
``os.replace``, so a reader never sees half a report: results published before a crash survive
it, and the launcher can follow a run (steps as they end, a rank's exit) by polling the files.
The file is one JSON object whose first line holds every field but ``results``, so a poller that
needs only the process state reads one line, not megabytes of case results
(``read_report(..., results=False)``).

Rank side::

    reporter = rank_report.reporter_for(out_dir, rank, world)   # the launcher's, under run_ranks
    reporter.publish("suite", "reducer")                         # results["suite"]; rewrites
    reporter.publish_entry("cases", name, record)                # results["cases"][name]

Launching side::

    rank_report.read_reports(out_dir, nranks)   # one RankReport (or None: wrote nothing) per rank
    rank_report.read_ranks(node_dir, range(8, 16))   # one node's ranks of a multi-node job

Under ``gradpool.app.launch.run_ranks`` the launcher names the directory in
``$GRADPOOL_RANK_REPORT_DIR`` and ``gradpool.app._rank_entry`` writes the start and exit records
into the same report the program publishes into (:func:`launched_reporter`).
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from gradpool.app import lifeline
from gradpool.errors import InvalidArgumentError

ENV_DIR = "GRADPOOL_RANK_REPORT_DIR"
FORMAT = "gradpool.rank_report/1"
RUNNING, EXITED = "running", "exited"
_SUFFIX = ".report.json"

logger = logging.getLogger(__name__)


@dataclass
class RankReport:
    rank: int
    world_size: Optional[int]       # None until the rank knows it (msrun exports MS_WORKER_NUM)
    pid: int
    role: str                       # MS_ROLE: "MS_WORKER" under msrun, "" in-process
    status: str = RUNNING           # RUNNING, then EXITED once exit_code is known
    exit_code: Optional[int] = None
    started: float = 0.0            # time.time() of the first write
    updated: float = 0.0            # time.time() of the latest write
    results: dict = field(default_factory=dict)
    format: str = FORMAT
    # the process's start time (lifeline.process_start): a pid the kernel reused for another
    # process is never taken for this rank's (None: no /proc, or a report written before)
    pid_start: Optional[str] = None

    @classmethod
    def from_dict(cls, data: dict) -> "RankReport":
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not names >= set(data):
            raise ValueError(f"not a {FORMAT} record")
        return cls(**data)


def report_path(directory, rank: int) -> Path:
    return Path(directory) / f"rank{rank}{_SUFFIX}"


def write_report(directory, report: RankReport, results_json: Optional[str] = None) -> Path:
    """Write ``report`` atomically (a reader sees the old file or the new one, never a mix).
    ``results_json``, when given, is the already encoded ``results`` (it replaces them)."""
    path = report_path(directory, report.rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = asdict(report)
    results = header.pop("results")
    if results_json is None:
        results_json = json.dumps(results)
    # The header's JSON has no newline (no indent; strings escape theirs): it is the first line.
    text = f'{json.dumps(header)[:-1]},\n"results": {results_json}}}\n'
    # The pid keeps two writers of one rank's report (there should be none) from sharing a tmp.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def read_report(directory, rank: int, results: bool = True) -> Optional[RankReport]:
    """Rank ``rank``'s report, or None when it wrote none; with ``results=False`` its ``results``
    are left unread (empty). A file that is not a report raises :class:`InvalidArgumentError`
    (writes are atomic, so this is never a half-written one)."""
    path = report_path(directory, rank)
    try:
        with open(path, encoding="utf-8") as fh:
            if results:
                text = fh.read()
            else:
                head = fh.readline()
                # write_report's first line: the header object, its closing brace left off
                text = head.rstrip()[:-1] + "}" if head.endswith(",\n") else head + fh.read()
    except FileNotFoundError:
        return None
    try:
        report = RankReport.from_dict(json.loads(text))
    except (ValueError, TypeError) as exc:
        raise InvalidArgumentError(f"{path} is not a rank report ({exc}); "
                                   "remove it or use a fresh directory") from None
    if not results:
        report.results = {}
    return report


def read_reports(directory, nranks: int, results: bool = True) -> list:
    """``[read_report(directory, r, results) for r in range(nranks)]``."""
    return read_ranks(directory, range(nranks), results)


def read_ranks(directory, ranks, results: bool = True) -> list:
    """The reports of ``ranks`` (e.g. one node's: ``range(first, first + local)``), in order."""
    return [read_report(directory, rank, results) for rank in ranks]


def remove_reports(directory) -> None:
    """Delete every report in ``directory``: a reused directory must not show an old run."""
    for stale in Path(directory).glob(f"rank*{_SUFFIX}"):
        stale.unlink(missing_ok=True)


class Reporter:
    """This process's report, rewritten to its file on every change.

    Results are kept encoded, each key (and each entry of a key filled by :meth:`publish_entry`)
    on its own, so a rewrite re-encodes only what changed: a suite of a hundred cases with
    arrays in them would otherwise spend most of its time re-encoding old cases."""

    def __init__(self, directory, rank: int, world_size: Optional[int] = None,
                 role: Optional[str] = None):
        now = time.time()
        self.directory = Path(directory)
        self.report = RankReport(rank=rank, world_size=world_size, pid=os.getpid(),
                                 role=os.environ.get("MS_ROLE", "") if role is None else role,
                                 started=now, updated=now,
                                 pid_start=lifeline.process_start(os.getpid()))
        self._encoded: dict = {}      # key -> JSON text, or {entry name -> JSON text}
        self._write()

    @property
    def path(self) -> Path:
        return report_path(self.directory, self.report.rank)

    def publish(self, key: str, value: Any) -> None:
        """Set ``results[key]`` to ``value`` and rewrite the file. The value is encoded now, so
        one JSON cannot hold fails here, and later changes to it are not seen."""
        self._encoded[key] = json.dumps(value)
        self._write()

    def publish_entry(self, key: str, name: str, value: Any) -> None:
        """Set ``results[key][name]`` to ``value`` and rewrite the file (a cheap way to grow a
        dict of results one entry at a time)."""
        entries = self._encoded.get(key, {})
        if isinstance(entries, str):          # published whole before: split it into entries
            decoded = json.loads(entries)
            if not isinstance(decoded, dict):
                raise InvalidArgumentError(
                    f"results[{key!r}] is a {type(decoded).__name__}, not a dict of entries")
            entries = {k: json.dumps(v) for k, v in decoded.items()}
        entries[name] = json.dumps(value)
        self._encoded[key] = entries
        self._write()

    def set_world_size(self, world_size: int) -> None:
        if self.report.world_size != world_size:
            self.report.world_size = world_size
            self._write()

    def finish(self, exit_code: int) -> None:
        """Record how the process ends (the last write before it exits)."""
        self.report.status, self.report.exit_code = EXITED, int(exit_code)
        self._write()

    def _write(self) -> None:
        self.report.updated = time.time()
        write_report(self.directory, self.report, _join(self._encoded))


def _join(encoded: dict) -> str:
    """The JSON object of already encoded members (a nested dict for entries)."""
    members = (f"{json.dumps(key)}: {_join(text) if isinstance(text, dict) else text}"
               for key, text in encoded.items())
    return "{" + ", ".join(members) + "}"


_launched: Optional[Reporter] = None


def launched_reporter() -> Optional[Reporter]:
    """The report of a rank started by ``run_ranks`` (``$GRADPOOL_RANK_REPORT_DIR`` and msrun's
    ``RANK_ID`` set; not msrun's scheduler process), created and written on first use; else None.
    One per process, so ``_rank_entry``'s start and exit records and the program's results land
    in one file."""
    global _launched
    directory, rank = os.environ.get(ENV_DIR), os.environ.get("RANK_ID")
    if not directory or rank is None or os.environ.get("MS_ROLE") == "MS_SCHED":
        return None
    if _launched is None or (_launched.directory, _launched.report.rank) != (Path(directory),
                                                                            int(rank)):
        world = os.environ.get("MS_WORKER_NUM")
        _launched = Reporter(directory, int(rank), int(world) if world else None)
    return _launched


def reporter_for(directory, rank: int, world_size: int) -> Reporter:
    """Where a program publishes its results: the launcher's report when ``run_ranks`` started
    this process (the launcher reads only that one), else a new report of ``rank`` in
    ``directory`` (an in-process run, which reads ``directory`` itself)."""
    reporter = launched_reporter()
    if reporter is None:
        return Reporter(directory, rank, world_size)
    if reporter.report.rank != rank:
        raise InvalidArgumentError(
            f"this process is rank {rank}, but msrun exported RANK_ID={reporter.report.rank}; "
            "its rank report would be filed under the wrong rank")
    if reporter.directory != Path(directory):
        logger.warning("rank %d publishes into the launcher's report in %s, not into %s",
                       rank, reporter.directory, directory)
    reporter.set_world_size(world_size)
    return reporter
