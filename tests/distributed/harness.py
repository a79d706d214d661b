"""Many named cases per msrun launch: run them on every rank, report them, check them in pytest.

A launch costs ~14 s, so a distributed test module launches once and parametrizes over the
cases. Each case runs on every rank, in the same order; one that raises is recorded as an error
and the next case runs (so a case must not raise on one rank between collectives the other
rank still enters: check arguments before communicating).

Rank side (``tests/distributed/<suite>_cases.py``)::

    from harness import Suite, allclose, raises
    suite = Suite("reducer")

    @suite.case
    def some_case(ctx):                 # ctx.rank, ctx.world_size, ctx.comm
        ...
        return {"shard": allclose(actual_tensor, expected_ndarray, dtype)}

    if __name__ == "__main__":
        suite.main()                    # argv: OUT_DIR [CASE ...]

Pytest side (``tests/distributed/suite_tests.py`` does this for a test class)::

    suite = harness.load_suite(CASES_SCRIPT)                 # at collection: suite.names
    results = harness.launch_suite(CASES_SCRIPT, suite.name, tmp_dir)   # class-scoped fixture
    results.verify("some_case")                              # one test per name

A case returns a dict of named checks (``allclose``, ``equal``, ``raises``), computed with NumPy
on the rank; :meth:`SuiteResults.verify` asserts them all, on every rank (a case with no checks
fails: it proved nothing).

Each rank publishes ``{"suite": NAME, "cases": {...}}`` as the results of its rank report
(:mod:`gradpool.app.rank_report`) after every case, so partial results survive a crash. Under
msrun that is the launcher's report of the rank (``launch_suite`` puts it in OUT_DIR); in-process
(world size 1) a report of rank 0 in OUT_DIR.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

# Small enough to keep in the JSON for a readable diff; larger checks keep a summary only.
_MAX_STORED = 4096
TOLERANCE = {"float32": (1e-6, 1e-6), "float16": (1e-3, 1e-3), "bfloat16": (1e-2, 1e-2),
             "float64": (1e-12, 1e-12)}


@dataclass
class Context:
    rank: int
    world_size: int
    comm: Any


# -- checks (rank side) --------------------------------------------------------------------------
def to_numpy(tensor) -> np.ndarray:
    """A float64 copy of a MindSpore tensor (bfloat16 has no NumPy dtype: read it as float32)."""
    import mindspore as ms
    if tensor.dtype == ms.bfloat16:
        tensor = tensor.astype(ms.float32)
    return np.array(tensor.asnumpy(), dtype=np.float64)   # asnumpy shares memory on CPU: copy


def dtype_name(dtype) -> str:
    return str(dtype).lower()


def allclose(actual, expected, dtype=None, rtol=None, atol=None, allow_empty=False) -> dict:
    """``actual`` (tensor or array) equals ``expected`` within the tolerance of ``dtype``
    (or the ``rtol``/``atol`` given). An empty ``actual`` compares nothing, so it fails unless
    ``expected`` is empty too and the caller says that is the point (``allow_empty``)."""
    actual = to_numpy(actual) if not isinstance(actual, np.ndarray) else actual.astype(np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    name = dtype_name(dtype) if dtype is not None else "float64"
    rtol = TOLERANCE[name][0] if rtol is None else rtol
    atol = TOLERANCE[name][1] if atol is None else atol
    check = {"kind": "allclose", "dtype": name, "rtol": rtol, "atol": atol,
             "shape": list(actual.shape), "expected_shape": list(expected.shape),
             "empty": actual.size == 0, "allow_empty": bool(allow_empty and expected.size == 0)}
    if actual.shape == expected.shape:
        bad = ~np.isclose(actual, expected, rtol=rtol, atol=atol)
        check["mismatches"] = int(bad.sum())
        check["max_abs_err"] = float(np.abs(actual - expected).max()) if actual.size else 0.0
        check["first_mismatches"] = [[int(i), float(actual.flat[i]), float(expected.flat[i])]
                                     for i in np.flatnonzero(bad)[:5]]
    if actual.size <= _MAX_STORED:
        check["actual"] = actual.tolist()
        check["expected"] = expected.tolist()
    return check


def equal(actual, expected) -> dict:
    return {"kind": "equal", "actual": actual, "expected": expected}


def raises(exc_type: type, fn: Callable[[], Any], *message_parts: str) -> dict:
    """``fn()`` raises ``exc_type`` (by class name) whose message holds every ``message_parts``."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded, asserted in pytest
        raised, message = type(exc).__name__, str(exc)
    else:
        raised, message = None, ""
    return {"kind": "raises", "expected": exc_type.__name__, "raised": raised,
            "message": message, "message_parts": list(message_parts)}


# -- running (rank side) -------------------------------------------------------------------------
class Suite:
    def __init__(self, name: str, blocking_launch: bool = False):
        """``blocking_launch``: run every msrun rank with blocking op launch, as ``gradpool train``
        runs CPU ranks. Under MindSpore's default asynchronous launch the queue threads of every
        rank compete for the 2-core machine's cores: a tiny-model training case took 15-75 s
        there against 2-23 s blocking (measured per case), so the training suites run blocking
        and the reducer suite, with fully_shard's fused and prefetching cases added to it,
        keeps the asynchronous queues covered on real ranks."""
        self.name = name
        self.blocking_launch = blocking_launch
        self.cases: dict[str, Callable[[Context], dict]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.cases)

    def case(self, fn: Callable[[Context], dict]) -> Callable[[Context], dict]:
        if fn.__name__ in self.cases:
            raise ValueError(f"case {fn.__name__!r} is defined twice in suite {self.name!r}")
        self.cases[fn.__name__] = fn
        return fn

    def add(self, name: str, fn: Callable[[Context], dict]) -> None:
        """Register a generated case (e.g. one per dtype) under ``name``."""
        fn.__name__ = name
        self.case(fn)

    def main(self, argv: Optional[list[str]] = None) -> None:
        """Entry point on each rank: ``OUT_DIR [CASE ...]``; publishes into the rank's report."""
        argv = sys.argv[1:] if argv is None else argv
        out_dir, only = Path(argv[0]), set(argv[1:])
        from gradpool.app import rank_report
        from gradpool.comm import communicator_for, init_distributed
        # First thing: in msrun's scheduler process this call serves the cluster and never returns.
        rank, world = init_distributed()
        from gradpool.device import block_launches, launches_blocking
        # Only on an msrun rank: a world-1 run in-process is pytest's own process, whose launch
        # mode must stay MindSpore's default for every later test (tests/conftest.py).
        if self.blocking_launch and os.environ.get("MS_ROLE") == "MS_WORKER":
            block_launches()
        ctx = Context(rank=rank, world_size=world, comm=communicator_for())
        reporter = rank_report.reporter_for(out_dir, rank, world)
        reporter.publish("suite", self.name)
        reporter.publish("blocking_launch", launches_blocking())   # as MindSpore reports it
        reporter.publish("cases", {})
        for name, fn in self.cases.items():
            if only and name not in only:
                continue
            # after every case: partial results survive a crash
            reporter.publish_entry("cases", name, _run_case(fn, ctx))


def _run_case(fn: Callable[[Context], dict], ctx: Context) -> dict:
    start = time.perf_counter()
    try:
        checks = fn(ctx)
        record = {"status": "ok", "checks": checks}
    except Exception as exc:  # noqa: BLE001 - one failing case must not hide the others
        record = {"status": "error", "error_type": type(exc).__name__, "message": str(exc),
                  "traceback": traceback.format_exc()}
    record["seconds"] = time.perf_counter() - start
    return record


# -- checking (pytest side) ----------------------------------------------------------------------
@dataclass
class SuiteResults:
    suite: str
    reports: list[dict]          # one per rank, in rank order: rank, world_size, pid, cases, ...
    launch: Any = None           # the gradpool.launch.LaunchResult

    def verify(self, name: str) -> None:
        for report in self.reports:
            record = report["cases"].get(name)
            where = f"case {name!r} on rank {report['rank']}"
            assert record is not None, f"{where}: not run (no result recorded)"
            assert record["status"] == "ok", \
                f"{where} raised {record['error_type']}: {record['message']}\n{record['traceback']}"
            assert isinstance(record["checks"], dict) and record["checks"], \
                f"{where}: case {name!r} returned no checks ({record['checks']!r})"
            for check_name, check in record["checks"].items():
                _verify_check(f"{where}, check {check_name!r}", check)

    def verify_every_rank_ran(self, names: list, nproc: int) -> None:
        """Every rank exited 0, reported its own rank and the world size, in its own process,
        and ran every case in order."""
        assert self.launch.exit_codes == (0,) * nproc
        for rank, report in enumerate(self.reports):
            assert (report["rank"], report["world_size"]) == (rank, nproc)
            assert list(report["cases"]) == list(names)
        assert len({report["pid"] for report in self.reports}) == nproc

    def verify_launch_mode(self, blocking: bool) -> None:
        """Every rank ran in the op launch mode its suite asks for (read back from MindSpore)."""
        modes = [report["results"].get("blocking_launch") for report in self.reports]
        assert modes == [blocking] * len(self.reports), modes

    def seconds(self, name: str) -> list[float]:
        return [report["cases"][name]["seconds"] for report in self.reports]


def load_results(out_dir, suite: str, nproc: int, launch=None) -> SuiteResults:
    """The rank reports in ``out_dir`` of a run of ``suite``, one per rank."""
    from gradpool.app import rank_report
    reports = []
    for rank, report in enumerate(rank_report.read_reports(out_dir, nproc)):
        path = rank_report.report_path(out_dir, rank)
        assert report is not None, f"rank {rank} wrote no results ({path} is missing)"
        assert report.results.get("suite") == suite, \
            f"{path} holds results of suite {report.results.get('suite')!r}, not {suite!r}"
        reports.append({**asdict(report), "cases": report.results.get("cases", {})})
    return SuiteResults(suite=suite, reports=reports, launch=launch)


def launch_suite(script, suite: str, out_dir, nproc: int = 2,
                 timeout: float = 600) -> SuiteResults:
    """One msrun launch of a cases script; its results, ready to verify per case."""
    from gradpool.app.launch import run_ranks
    launch = run_ranks(script, args=[str(out_dir)], nproc=nproc,
                       log_dir=Path(out_dir) / "logs", timeout=timeout, report_dir=out_dir)
    return load_results(out_dir, suite, nproc, launch)


DIST_DIR = Path(__file__).resolve().parent


def load_suite(script) -> Suite:
    """Import a cases script without running it (for its case names at collection time)."""
    import importlib.util
    script = Path(script)
    if str(script.parent) not in sys.path:
        sys.path.insert(0, str(script.parent))     # the script imports ``harness``
    spec = importlib.util.spec_from_file_location(f"_cases_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module     # dataclasses defined in the script look their module up
    spec.loader.exec_module(module)
    return module.suite


def _verify_check(where: str, check: dict) -> None:
    kind = check["kind"]
    if kind == "allclose":
        assert check["shape"] == check["expected_shape"], \
            f"{where}: shape {check['shape']}, expected {check['expected_shape']}"
        assert not check["empty"] or check["allow_empty"], \
            f"{where}: actual is empty (shape {check['shape']}): nothing was compared"
        if "actual" in check:
            np.testing.assert_allclose(check["actual"], check["expected"], rtol=check["rtol"],
                                       atol=check["atol"], err_msg=where)
        assert check["mismatches"] == 0, (
            f"{where}: {check['mismatches']} elements differ (max abs err {check['max_abs_err']}, "
            f"rtol {check['rtol']}, atol {check['atol']}); first [index, actual, expected]: "
            f"{check['first_mismatches']}")
    elif kind == "equal":
        assert check["actual"] == check["expected"], \
            f"{where}: got {check['actual']!r}, expected {check['expected']!r}"
    elif kind == "raises":
        assert check["raised"] == check["expected"], \
            f"{where}: expected {check['expected']}, got {check['raised']}: {check['message']}"
        for part in check["message_parts"]:
            assert part in check["message"], \
                f"{where}: message lacks {part!r}: {check['message']}"
    else:
        raise AssertionError(f"{where}: unknown check kind {kind!r}")


@contextlib.contextmanager
def wrapped_communicators(wrap: Callable[[Any], Any]):
    """Runtimes built inside get ``wrap(communicator)`` for every group's communicator; yields
    the list of the wrapped ones. Runtimes are rebuilt on entry and forgotten on exit."""
    from gradpool import runtime as runtime_module
    original = runtime_module.communicator_for
    made = []

    def wrapped(device=None, group=None):
        made.append(wrap(original(device, group)))
        return made[-1]

    runtime_module.communicator_for = wrapped
    runtime_module.reset_runtimes()
    try:
        yield made
    finally:
        runtime_module.communicator_for = original
        runtime_module.reset_runtimes()


def late_communicators(delay_seconds: float = 0.02):
    """:func:`wrapped_communicators` whose collectives run, read their input and write their
    output only when waited on, ``delay_seconds`` after launch at the earliest
    (``FaultInjectingCommunicator(read_input_at="wait")``)."""
    from gradpool.testing import FaultInjectingCommunicator
    return wrapped_communicators(lambda inner: FaultInjectingCommunicator(
        inner, delay_seconds=delay_seconds, read_input_at="wait"))


def assert_trains_like_unsharded(cfg, model, records, rtol: float = 0.0, atol: float = 0.0):
    """In one process (world size 1): ``records``' losses and ``model``'s final parameters equal
    the unsharded model's trained on the same batches, bit for bit unless a tolerance is given
    (``rtol`` for losses and parameters, ``atol`` for parameters)."""
    from gradpool.app.train import gathered_params, train_reference
    ref_losses, ref_params = train_reference(cfg, world=1)
    np.testing.assert_allclose([r.loss for r in records], ref_losses, rtol=rtol, atol=0)
    got = gathered_params(model)
    for name, want in ref_params.items():
        np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=name)
