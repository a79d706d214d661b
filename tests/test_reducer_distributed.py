"""GradReducer on 2 real CPU ranks: ONE msrun launch runs every case in
tests/distributed/reducer_cases.py (reduce-scatter and all-reduce against NumPy for every op,
reduce dtype, gradient dtype and bucketing; accumulation; zero-copy; fences under delayed
completion; wait() failures), and each case is a test here."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402

CASES_SCRIPT = DIST_DIR / "reducer_cases.py"
SUITE = harness.load_suite(CASES_SCRIPT)
NPROC = 2

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def reducer_results(tmp_path_factory):
    return harness.launch_suite(CASES_SCRIPT, SUITE.name, tmp_path_factory.mktemp("reducer"),
                                nproc=NPROC, timeout=400)


def test_every_rank_ran_every_case_at_world_size_2(reducer_results):
    assert reducer_results.launch.exit_codes == (0,) * NPROC
    for rank, report in enumerate(reducer_results.reports):
        assert (report["rank"], report["world_size"]) == (rank, NPROC)
        assert list(report["cases"]) == SUITE.names
    assert reducer_results.reports[0]["pid"] != reducer_results.reports[1]["pid"]


@pytest.mark.parametrize("name", SUITE.names)
def test_case(reducer_results, name):
    reducer_results.verify(name)
