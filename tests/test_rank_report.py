"""The rank report (gradpool.app.rank_report) without msrun: writer, reader, the launched rank's
report as _rank_entry writes it, the launcher's dead-rank test, and the harness's checks on top."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from gradpool.app import rank_report
from gradpool.app.launch import dead_rank, pid_alive
from gradpool.app.rank_report import EXITED, RUNNING, RankReport, Reporter
from gradpool.errors import InvalidArgumentError

sys.path.insert(0, str(Path(__file__).parent / "distributed"))
import harness  # noqa: E402


@pytest.fixture
def no_launch(monkeypatch):
    """This process as the launcher or an in-process run: no launched report, no msrun env."""
    for name in (rank_report.ENV_DIR, "RANK_ID", "MS_ROLE", "MS_WORKER_NUM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(rank_report, "_launched", None)


# -- writer and reader -------------------------------------------------------------------------
def test_reporter_writes_the_start_record_then_results_then_the_exit(tmp_path, no_launch):
    reporter = Reporter(tmp_path, rank=1, world_size=2)
    start = rank_report.read_report(tmp_path, 1)
    assert (start.rank, start.world_size, start.pid, start.role) == (1, 2, os.getpid(), "")
    assert (start.status, start.exit_code, start.results) == (RUNNING, None, {})
    assert reporter.path == rank_report.report_path(tmp_path, 1) == tmp_path / "rank1.report.json"

    rows = [{"a": 1}]
    reporter.publish("rows", rows)
    rows.append({"a": 2})                        # copied at publish: not in the file yet
    assert rank_report.read_report(tmp_path, 1).results == {"rows": [{"a": 1}]}
    reporter.publish("rows", rows)
    reporter.publish("suite", "s")
    assert rank_report.read_report(tmp_path, 1).results == {"rows": [{"a": 1}, {"a": 2}],
                                                             "suite": "s"}
    reporter.finish(3)
    end = rank_report.read_report(tmp_path, 1)
    assert (end.status, end.exit_code) == (EXITED, 3)
    assert end.started == start.started and end.updated >= start.updated
    assert end.results["suite"] == "s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1.report.json"]   # no tmp left


def test_publish_of_a_value_json_cannot_hold_fails_and_keeps_the_file(tmp_path, no_launch):
    reporter = Reporter(tmp_path, rank=0, world_size=1)
    reporter.publish("ok", 1)
    with pytest.raises(TypeError):
        reporter.publish("bad", object())
    assert rank_report.read_report(tmp_path, 0).results == {"ok": 1}


def test_publish_entry_grows_a_dict_one_entry_at_a_time(tmp_path, no_launch):
    reporter = Reporter(tmp_path, rank=0, world_size=1)
    reporter.publish("cases", {"a": {"n": 1}})
    reporter.publish_entry("cases", "b", {"n": 2})
    reporter.publish_entry("cases", "a", {"n": 3})           # replaces, keeps its place
    reporter.publish_entry("new", "x", [1.5, None])
    assert rank_report.read_report(tmp_path, 0).results == {
        "cases": {"a": {"n": 3}, "b": {"n": 2}}, "new": {"x": [1.5, None]}}
    assert list(rank_report.read_report(tmp_path, 0).results["cases"]) == ["a", "b"]
    reporter.publish("rows", [1])
    with pytest.raises(InvalidArgumentError, match="not a dict of entries"):
        reporter.publish_entry("rows", "x", 1)


def test_the_first_line_is_the_header_so_a_poller_skips_the_results(tmp_path, no_launch):
    reporter = Reporter(tmp_path, rank=0, world_size=2)
    reporter.publish("big", ["x" * 100] * 1000)
    reporter.finish(3)
    head = rank_report.read_report(tmp_path, 0, results=False)
    full = rank_report.read_report(tmp_path, 0)
    assert head.results == {} and len(full.results["big"]) == 1000
    assert dataclasses.replace(full, results={}) == head
    assert len(reporter.path.read_text().splitlines()[0]) < 400
    # a report laid out otherwise (pretty-printed) still reads, the whole file then
    pretty = dataclasses.asdict(full)
    reporter.path.write_text(json.dumps(pretty, indent=1))
    assert rank_report.read_report(tmp_path, 0, results=False) == head


def test_read_reports_gives_none_for_a_rank_that_wrote_nothing(tmp_path, no_launch):
    Reporter(tmp_path, rank=1, world_size=3)
    reports = rank_report.read_reports(tmp_path, 3)
    assert reports[0] is None and reports[2] is None and reports[1].rank == 1
    assert rank_report.read_report(tmp_path / "missing", 0) is None


@pytest.mark.parametrize("content", ["{not json", json.dumps({"rank": 0}), "[]",
                                     json.dumps({"format": rank_report.FORMAT, "rank": 0})])
def test_a_file_that_is_not_a_report_raises(tmp_path, content):
    rank_report.report_path(tmp_path, 0).write_text(content)
    with pytest.raises(InvalidArgumentError, match="is not a rank report"):
        rank_report.read_report(tmp_path, 0)


def test_remove_reports_removes_only_reports(tmp_path, no_launch):
    Reporter(tmp_path, rank=0, world_size=1)
    Reporter(tmp_path, rank=1, world_size=1)
    (tmp_path / "worker_0.log").write_text("log")
    rank_report.remove_reports(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["worker_0.log"]


def test_a_reader_never_sees_a_half_written_report(tmp_path, no_launch):
    # ~1 MB rewrites while another thread reads: without tmp + os.replace the reader would see
    # a truncated file (a JSON error) within a few hundred reads.
    reporter = Reporter(tmp_path, rank=0, world_size=1)
    big = ["x" * 1000] * 1000
    stop = threading.Event()

    def rewrite():
        n = 0
        while not stop.is_set():
            n += 1
            reporter.publish("big", big + [n])
    writer = threading.Thread(target=rewrite)
    writer.start()
    try:
        for _ in range(300):
            assert len(rank_report.read_report(tmp_path, 0).results.get("big", big + [0])) == 1001
    finally:
        stop.set()
        writer.join()


# -- the launched rank's report ------------------------------------------------------------------
def _launched_env(monkeypatch, directory, rank="1", role="MS_WORKER"):
    monkeypatch.setattr(rank_report, "_launched", None)
    monkeypatch.setenv(rank_report.ENV_DIR, str(directory))
    monkeypatch.setenv("RANK_ID", rank)
    monkeypatch.setenv("MS_ROLE", role)
    monkeypatch.setenv("MS_WORKER_NUM", "2")


def test_launched_reporter_is_one_per_process_from_the_launcher_env(tmp_path, monkeypatch):
    _launched_env(monkeypatch, tmp_path)
    reporter = rank_report.launched_reporter()
    assert reporter is rank_report.launched_reporter()
    report = rank_report.read_report(tmp_path, 1)
    assert (report.rank, report.world_size, report.role) == (1, 2, "MS_WORKER")
    # a program's reporter_for is that same report, whatever directory it names
    assert rank_report.reporter_for(tmp_path / "elsewhere", 1, 2) is reporter
    with pytest.raises(InvalidArgumentError, match="RANK_ID=1"):
        rank_report.reporter_for(tmp_path, 0, 2)


def test_no_launched_reporter_in_the_scheduler_or_outside_run_ranks(tmp_path, monkeypatch,
                                                                    no_launch):
    assert rank_report.launched_reporter() is None
    reporter = rank_report.reporter_for(tmp_path, 0, 1)        # in-process: a fresh report
    assert reporter.directory == tmp_path and rank_report.read_report(tmp_path, 0).world_size == 1
    _launched_env(monkeypatch, tmp_path / "sched", role="MS_SCHED")
    assert rank_report.launched_reporter() is None
    assert not (tmp_path / "sched").exists()


SCRIPT = """
import sys
from gradpool.app import rank_report
rank_report.reporter_for("unused", 1, 2).publish("answer", 42)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_rank_entry_records_start_results_and_exit_code(tmp_path, code):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, rank_report.ENV_DIR: str(tmp_path), "RANK_ID": "1",
           "MS_ROLE": "MS_WORKER", "MS_WORKER_NUM": "2"}
    proc = subprocess.run([sys.executable, "-m", "gradpool.app._rank_entry", str(script),
                           str(code)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    report = rank_report.read_report(tmp_path, 1)
    assert (report.status, report.exit_code, report.results) == (EXITED, code, {"answer": 42})
    assert report.role == "MS_WORKER" and report.world_size == 2
    assert "[gradpool.launch]" not in proc.stdout         # no marker lines in the log any more


# -- the launcher's test for a dead rank ---------------------------------------------------------
def _report(rank, pid, exit_code=None):
    return RankReport(rank=rank, world_size=2, pid=pid, role="MS_WORKER",
                      status=RUNNING if exit_code is None else EXITED, exit_code=exit_code)


def _gone_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_pid_alive_sees_running_zombie_and_gone_processes():
    assert pid_alive(os.getpid())
    assert not pid_alive(_gone_pid())
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        for _ in range(200):           # until it has exited; nobody reaps it while we hold it
            if not pid_alive(zombie.pid):
                break
            time.sleep(0.05)
        assert not pid_alive(zombie.pid)
        assert Path(f"/proc/{zombie.pid}").exists()      # a zombie, not yet reaped
    finally:
        zombie.wait()


def test_dead_rank_is_a_non_zero_exit_or_a_vanished_process():
    me, gone = os.getpid(), _gone_pid()
    assert dead_rank(lambda: [None, None]) is None                     # not started yet
    assert dead_rank(lambda: [_report(0, me), _report(1, me)]) is None  # both running
    assert dead_rank(lambda: [_report(0, me), _report(1, gone, 0)]) is None   # exited 0
    assert dead_rank(lambda: [_report(0, me), _report(1, me, 3)]) == 1  # recorded, still alive
    assert dead_rank(lambda: [_report(0, gone), _report(1, me)]) == 0   # vanished, no record
    # it recorded exit 0 between the read and the pid check: not dead
    reads = iter([[_report(0, gone), None], [_report(0, gone, 0), None]])
    assert dead_rank(lambda: next(reads)) is None


# -- killing a rank by pid: only while the pid is still the rank's ------------------------------
def test_a_rank_is_killed_only_while_its_pid_is_still_its_process(tmp_path):
    """The launcher's stop path (supervise._stop) kills a rank's process group by the pid its
    report holds. A report whose start time is another process's (the rank died, the kernel gave
    its pid to this one) or that has none leaves the process alone; the rank's own is killed."""
    from gradpool.app import lifeline, supervise
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)     # a session, as msrun's
    try:
        start = lifeline.process_start(victim.pid)
        assert start is not None
        launch = types.SimpleNamespace(report_dir=tmp_path, spec=types.SimpleNamespace(ranks=[0]))
        for other in (str(int(start) - 1), None):       # reused pid; no start time recorded
            rank_report.write_report(tmp_path, RankReport(
                rank=0, world_size=1, pid=victim.pid, role="MS_WORKER", pid_start=other))
            supervise._stop([], launch, via_msrun=False)
            time.sleep(0.2)
            assert victim.poll() is None, f"killed a process that was not the rank's ({other})"
        rank_report.write_report(tmp_path, RankReport(
            rank=0, world_size=1, pid=victim.pid, role="MS_WORKER", pid_start=start))
        supervise._stop([], launch, via_msrun=False)
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


@pytest.mark.parametrize("commits", [True, False], ids=["commits", "grace_passes"])
def test_a_stop_signal_waits_for_the_save_in_progress_within_the_grace(tmp_path, caplog,
                                                                       no_launch, commits):
    """The launcher's stop path with a rank (this process) that has the save of step 4 in
    flight: it says it waits, and returns once the rank reports it committed (a save started
    later is not waited for), or once the grace has passed, saying so."""
    from gradpool.app import checkpoints, supervise
    launch = types.SimpleNamespace(report_dir=tmp_path, spec=types.SimpleNamespace(ranks=[0]))
    reporter = Reporter(tmp_path, rank=0, world_size=1)
    reporter.publish(checkpoints.SAVE_IN_FLIGHT, {"path": "ckpt/step-00000004", "step": 4})
    busy = subprocess.Popen(["sleep", "30"])          # a launch process still running

    def commit_then_start_the_next():
        time.sleep(0.6)
        reporter.publish(checkpoints.LAST_CHECKPOINT, {"path": "ckpt/step-00000004", "step": 4})
        reporter.publish(checkpoints.SAVE_IN_FLIGHT, {"path": "ckpt/step-00000006", "step": 6})
    committer = threading.Thread(target=commit_then_start_the_next)
    if commits:
        committer.start()
    start = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="gradpool.launch"):
            supervise._let_save_commit(launch, [busy], signal.SIGTERM, grace=3.0)
    finally:
        busy.kill()
        busy.wait()
        if commits:
            committer.join()
    waited = time.monotonic() - start
    said = [r.getMessage() for r in caplog.records]
    assert said[0] == ("SIGTERM: letting the save of step 4 finish and commit before stopping "
                       "the ranks (up to 3 s: train.stop_save_grace_s)")
    if commits:
        assert 0.5 < waited < 2.5 and len(said) == 2, (waited, said)
        assert said[1].startswith("SIGTERM: the save of step 4 committed after ")
    else:
        assert 3.0 <= waited < 4.5 and said[1:] == [
            "SIGTERM: the save of step 4 did not commit within 3 s (train.stop_save_grace_s); "
            "it stays uncommitted"], (waited, said)


def test_a_report_records_its_process_start_time(tmp_path, no_launch):
    from gradpool.app import lifeline
    Reporter(tmp_path, rank=0, world_size=1)
    report = rank_report.read_report(tmp_path, 0)
    assert report.pid_start == lifeline.process_start(os.getpid()) is not None


# -- the harness's checks on top of the reports --------------------------------------------------
def _results(checks) -> harness.SuiteResults:
    record = {"status": "ok", "checks": checks, "seconds": 0.0}
    return harness.SuiteResults("s", [{"rank": 0, "cases": {"c": record}}])


@pytest.mark.parametrize("checks", [{}, None])
def test_a_case_with_no_checks_fails_verify(checks):
    with pytest.raises(AssertionError, match="case 'c' returned no checks"):
        _results(checks).verify("c")


def test_allclose_of_an_empty_array_is_not_close():
    empty = np.zeros((0,))
    with pytest.raises(AssertionError, match="actual is empty"):
        _results({"x": harness.allclose(empty, empty)}).verify("c")
    with pytest.raises(AssertionError):
        _results({"x": harness.allclose(empty, np.ones(3), allow_empty=True)}).verify("c")
    _results({"x": harness.allclose(empty, empty, allow_empty=True)}).verify("c")
    _results({"x": harness.allclose(np.ones(3), np.ones(3))}).verify("c")


def test_load_results_reads_the_suite_from_the_reports(tmp_path, no_launch):
    reporter = Reporter(tmp_path, rank=0, world_size=1)
    reporter.publish("suite", "s")
    reporter.publish("cases", {"c": {"status": "ok", "checks": {"x": harness.equal(1, 1)},
                                     "seconds": 0.0}})
    results = harness.load_results(tmp_path, "s", nproc=1)
    assert results.reports[0]["world_size"] == 1 and results.reports[0]["pid"] == os.getpid()
    results.verify("c")
    with pytest.raises(AssertionError, match="not 'other'"):
        harness.load_results(tmp_path, "other", nproc=1)
    with pytest.raises(AssertionError, match="rank 1 wrote no results"):
        harness.load_results(tmp_path, "s", nproc=2)


def test_read_ranks_reads_one_nodes_ranks(tmp_path, no_launch):
    Reporter(tmp_path, rank=9, world_size=16)
    reports = rank_report.read_ranks(tmp_path, range(8, 10))
    assert reports[0] is None and reports[1].rank == 9


def test_a_launch_watches_fresh_reports_of_other_nodes_only(tmp_path, no_launch):
    # On a shared filesystem node 0 sees node 1's failing rank (an exit code, since its pid is
    # another host's) but not a report an earlier run left behind.
    from gradpool.app.launch import NodeSpec, _Watch, build_node_launch
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    spec = NodeSpec(world=2, local=1, node_rank=0, nodes=2, master_port=29999)
    launch = build_node_launch(spec, __file__, log_dir=node0, master_is_local=True)
    watch = _Watch(launch, {1: node1})
    Reporter(node0, rank=0, world_size=2)                   # this node's rank: running (me)
    assert watch.dead() is None
    stale = RankReport(rank=1, world_size=2, pid=_gone_pid(), role="MS_WORKER",
                       status=EXITED, exit_code=3, started=time.time() - 3600)
    rank_report.write_report(node1, stale)
    assert watch.dead() is None                             # an earlier run's: ignored
    Reporter(node1, rank=1, world_size=2).finish(3)
    assert watch.dead() == 1
