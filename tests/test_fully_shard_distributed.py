"""fully_shard end to end on 2 real CPU ranks: ONE msrun launch runs every case of
tests/distributed/fsdp_cases.py (each trains 5 steps against an unsharded reference)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402

CASES_SCRIPT = DIST_DIR / "fsdp_cases.py"
SUITE = harness.load_suite(CASES_SCRIPT)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def fsdp_results(tmp_path_factory):
    return harness.launch_suite(CASES_SCRIPT, SUITE.name, tmp_path_factory.mktemp("fsdp"),
                                nproc=2, timeout=900)


@pytest.mark.parametrize("name", SUITE.names)
def test_case(fsdp_results, name):
    fsdp_results.verify(name)
