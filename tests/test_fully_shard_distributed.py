"""fully_shard end to end on 2 real CPU ranks: ONE msrun launch runs every case of
tests/distributed/fsdp_cases.py. Each case checks, per rank and per element, the reduced shard
gradients and main_grad (after one and after several micro-steps) against the unsharded
reference's gradient chunks, then trains against it (see that file)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402

CASES_SCRIPT = DIST_DIR / "fsdp_cases.py"
SUITE = harness.load_suite(CASES_SCRIPT)
NPROC = 2

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return harness.launch_suite(CASES_SCRIPT, SUITE.name, tmp_path_factory.mktemp("fsdp"),
                                nproc=NPROC, timeout=1500)


def test_every_rank_ran_every_case_at_world_size_2(fsdp_results):
    assert fsdp_results.launch.exit_codes == (0,) * NPROC
    for rank, report in enumerate(fsdp_results.reports):
        assert (report["rank"], report["world_size"]) == (rank, NPROC)
        assert list(report["cases"]) == SUITE.names


@pytest.mark.parametrize("name", SUITE.names)
def test_case(fsdp_results, name):
    fsdp_results.verify(name)
