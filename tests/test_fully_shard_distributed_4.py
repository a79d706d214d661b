"""fully_shard end to end on 4 real CPU ranks: ONE msrun launch runs the cases chosen in
tests/distributed/fsdp_cases_4.py (four-way sums, other uneven shards, the gradient's scale at
W=4), with the same per-rank, per-element checks as the 2-rank launch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402

CASES_SCRIPT = DIST_DIR / "fsdp_cases_4.py"
SUITE = harness.load_suite(CASES_SCRIPT)
NPROC = 4

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def fsdp4_results(tmp_path_factory):
    return harness.launch_suite(CASES_SCRIPT, SUITE.name, tmp_path_factory.mktemp("fsdp4"),
                                nproc=NPROC, timeout=1500)


def test_every_rank_ran_every_case_at_world_size_4(fsdp4_results):
    assert fsdp4_results.launch.exit_codes == (0,) * NPROC
    for rank, report in enumerate(fsdp4_results.reports):
        assert (report["rank"], report["world_size"]) == (rank, NPROC)
        assert list(report["cases"]) == SUITE.names
    assert len({report["pid"] for report in fsdp4_results.reports}) == NPROC


@pytest.mark.parametrize("name", SUITE.names)
def test_case(fsdp4_results, name):
    fsdp4_results.verify(name)
