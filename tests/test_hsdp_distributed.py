"""HSDP on 4 real CPU ranks: ONE msrun launch runs every case of tests/distributed/hsdp_cases.py
(mesh (2, 2): reduce-scatter in the shard group, all-reduce across the replicas), each a test."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402

CASES_SCRIPT = DIST_DIR / "hsdp_cases.py"
SUITE = harness.load_suite(CASES_SCRIPT)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def hsdp_results(tmp_path_factory):
    return harness.launch_suite(CASES_SCRIPT, SUITE.name, tmp_path_factory.mktemp("hsdp"),
                                nproc=4, timeout=900)


@pytest.mark.parametrize("name", SUITE.names)
def test_case(hsdp_results, name):
    hsdp_results.verify(name)
