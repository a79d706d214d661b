"""Communicators on 2 real CPU ranks: ONE msrun launch runs every case in
tests/distributed/comm_cases.py, and each case is a test here. Plus a cheap launch whose rank 1
fails, for gradpool.launch's error path."""
from __future__ import annotations

import os
import time

import pytest

import harness
from suite_tests import SuiteTests
from gradpool.app.errors import LaunchError
from gradpool.app import rank_report
from gradpool.app.launch import pid_alive, run_ranks

DIST_DIR = harness.DIST_DIR
NPROC = 2

pytestmark = pytest.mark.distributed


class TestCommunicatorsOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "comm_cases.py", NPROC, 300, None

    def test_launch_reports_every_rank_exit_code(self, suite_results):
        launch = suite_results.launch
        assert launch.exit_codes == (0,) * NPROC
        assert launch.ok and launch.returncode == 0
        # _rank_entry recorded each rank's start and exit in its report, under msrun's worker pid
        for rank, result in enumerate(launch.ranks):
            report = result.report
            assert (report.rank, report.world_size, report.role) == (rank, NPROC, "MS_WORKER")
            assert (report.status, report.exit_code) == (rank_report.EXITED, 0)
            assert report.pid == result.pid and report.results["suite"] == self.suite().name
        assert launch.ranks[0].pid != launch.ranks[1].pid


def test_failing_rank_raises_launch_error_within_seconds(tmp_path):
    # Rank 1 exits 3 at once but its process lingers, rank 0 sleeps: msrun alone would wait
    # 120 s for both. The launcher sees rank 1's report and stops everything a few seconds later.
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ranks(DIST_DIR / "fail_rank1.py", nproc=NPROC, log_dir=tmp_path, timeout=300)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 1: exit code 3")
    assert "after rank 1 failed" in message
    assert "rank-1-sentinel-4711: failing on purpose" in message      # rank 1's log tail
    assert "worker_1.log" in message
    result = info.value.result
    assert result.exit_codes == (None, 3)      # rank 0 was killed by the launcher, not exited
    assert result.failed_ranks[0].rank == 1 and result.stopped_for == 1
    assert result.seconds < 30 and elapsed < 30, (result.seconds, elapsed)
    # nothing it started survives: rank 0's sleep and rank 1's lingering process are gone
    pids = [r.pid for r in result.ranks]
    assert None not in pids and not any(map(pid_alive, pids))


def test_a_launch_ends_as_soon_as_every_rank_has_ended_well(tmp_path):
    # msrun's scheduler would wait for these ranks until the cluster timeout (they never
    # initialize communication): only the launcher ending msrun lets the launch end in time.
    start = time.monotonic()
    result = run_ranks(DIST_DIR / "ranks_exit_ok.py", nproc=NPROC, log_dir=tmp_path, timeout=90)
    elapsed = time.monotonic() - start
    assert result.ok and result.exit_codes == (0, 0) and result.returncode == 0
    assert elapsed < 60, elapsed
    script = str(DIST_DIR / "ranks_exit_ok.py")
    assert not [pid for pid in _pids() if script in _cmdline(pid)], "a process of it survived"


def _pids() -> list:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_a_node_started_without_msrun_reports_and_stops_its_failing_rank(tmp_path):
    # Node 1 of 2 on the master's host starts its worker itself (no msrun: it would start a
    # second scheduler). fail_rank1.py imports no MindSpore; its rank 1 exits 3 and lingers.
    from gradpool.app.launch import NodeSpec, build_node_launch, run_node
    spec = NodeSpec(world=2, local=1, node_rank=1, nodes=2, master_addr="127.0.0.1",
                    master_port=29999, cluster_timeout_s=30)
    node = build_node_launch(spec, DIST_DIR / "fail_rank1.py", log_dir=tmp_path,
                             master_is_local=True)
    assert not node.via_msrun
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_node(node, timeout=300)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 1: exit code 3")
    assert "rank-1-sentinel-4711: failing on purpose" in message and "worker_1.log" in message
    result = info.value.result
    assert [r.rank for r in result.ranks] == [1] and result.stopped_for == 1
    report = result.ranks[0].report
    assert (report.rank, report.world_size, report.role) == (1, 2, "MS_WORKER")
    assert elapsed < 30 and not pid_alive(result.ranks[0].pid)
