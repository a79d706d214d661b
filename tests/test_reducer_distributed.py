"""GradReducer on 2 real CPU ranks: ONE msrun launch runs every case in
tests/distributed/reducer_cases.py (reduce-scatter and all-reduce against NumPy for every op,
reduce dtype, gradient dtype and bucketing; accumulation; zero-copy; fences under delayed
completion; wait() failures; two fully_shard cases under the asynchronous launch), and each
case is a test here."""
from __future__ import annotations

import pytest

import harness

NPROC = 2
SUITE, reducer_results = harness.suite_fixture("reducer_cases.py", "reducer_results", nproc=NPROC,
                                      timeout=400)

pytestmark = pytest.mark.distributed


def test_every_rank_ran_every_case_at_world_size_2(reducer_results):
    reducer_results.verify_every_rank_ran(SUITE.names, NPROC)
    reducer_results.verify_launch_mode(blocking=False)   # MindSpore's default: async queues


@pytest.mark.parametrize("name", SUITE.names)
def test_case(reducer_results, name):
    reducer_results.verify(name)
