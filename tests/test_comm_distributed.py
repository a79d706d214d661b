"""Communicators on 2 real CPU ranks: ONE msrun launch runs every case in
tests/distributed/comm_cases.py, and each case is a test here. Plus a cheap launch whose rank 1
fails, for gradpool.launch's error path."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gradpool.errors import LaunchError
from gradpool.app.launch import run_ranks

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402

CASES_SCRIPT = DIST_DIR / "comm_cases.py"
SUITE = harness.load_suite(CASES_SCRIPT)
NPROC = 2

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def comm_results(tmp_path_factory):
    return harness.launch_suite(CASES_SCRIPT, SUITE.name, tmp_path_factory.mktemp("comm"),
                                nproc=NPROC, timeout=300)


def test_launch_reports_every_rank_exit_code(comm_results):
    launch = comm_results.launch
    assert launch.exit_codes == (0,) * NPROC
    assert launch.ok and launch.returncode == 0
    assert all("exit_code=0" in tail for tail in launch.log_tails)


@pytest.mark.parametrize("name", SUITE.names)
def test_case(comm_results, name):
    comm_results.verify(name)


def test_failing_rank_raises_launch_error_with_its_log_tail(tmp_path):
    with pytest.raises(LaunchError) as info:
        run_ranks(DIST_DIR / "fail_rank1.py", nproc=NPROC, log_dir=tmp_path, timeout=120)
    message = str(info.value)
    assert message.startswith("rank 1: exit code 3")
    assert "rank-1-sentinel-4711: failing on purpose" in message      # rank 1's log tail
    assert "worker_1.log" in message
    result = info.value.result
    assert result.exit_codes == (None, 3)      # rank 0 was killed by msrun, not exited
    assert result.failed_ranks[0].rank == 1
    assert result.seconds < 60                 # msrun killed rank 0's 60 s sleep
