"""fully_shard end to end on 2 real CPU ranks: ONE msrun launch runs every case of
tests/distributed/fsdp_cases.py. Each case checks, per rank and per element, the reduced shard
gradients and main_grad (after one and after several micro-steps) against the unsharded
reference's gradient chunks, then trains against it (see that file)."""
from __future__ import annotations

import pytest

import harness

NPROC = 2
SUITE, fsdp_results = harness.suite_fixture("fsdp_cases.py", "fsdp_results", nproc=NPROC,
                                      timeout=1500)

pytestmark = pytest.mark.distributed


def test_every_rank_ran_every_case_at_world_size_2(fsdp_results):
    fsdp_results.verify_every_rank_ran(SUITE.names, NPROC)
    fsdp_results.verify_launch_mode(blocking=True)


@pytest.mark.parametrize("name", SUITE.names)
def test_case(fsdp_results, name):
    fsdp_results.verify(name)
