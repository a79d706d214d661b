"""HSDP on 4 real CPU ranks: ONE msrun launch runs every case of tests/distributed/hsdp_cases.py
(mesh (2, 2): reduce-scatter in the shard group, all-reduce across the replicas), each a test."""
from __future__ import annotations

import pytest

import harness

NPROC = 4
SUITE, hsdp_results = harness.suite_fixture("hsdp_cases.py", "hsdp_results", nproc=NPROC,
                                      timeout=900)

pytestmark = pytest.mark.distributed


def test_every_rank_ran_every_case_blocking(hsdp_results):
    hsdp_results.verify_every_rank_ran(SUITE.names, NPROC)
    hsdp_results.verify_launch_mode(blocking=True)


@pytest.mark.parametrize("name", SUITE.names)
def test_case(hsdp_results, name):
    hsdp_results.verify(name)
