"""fully_shard end to end on 4 real CPU ranks: ONE msrun launch runs the cases chosen in
tests/distributed/fsdp_cases_4.py (four-way sums, other uneven shards, the gradient's scale at
W=4), with the same per-rank, per-element checks as the 2-rank launch."""
from __future__ import annotations

import pytest

import harness

NPROC = 4
SUITE, fsdp4_results = harness.suite_fixture("fsdp_cases_4.py", "fsdp4_results", nproc=NPROC,
                                      timeout=1500)

pytestmark = pytest.mark.distributed


def test_every_rank_ran_every_case_at_world_size_4(fsdp4_results):
    fsdp4_results.verify_every_rank_ran(SUITE.names, NPROC)
    fsdp4_results.verify_launch_mode(blocking=True)


@pytest.mark.parametrize("name", SUITE.names)
def test_case(fsdp4_results, name):
    fsdp4_results.verify(name)
