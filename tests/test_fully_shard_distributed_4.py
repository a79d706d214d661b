"""fully_shard end to end on 4 real CPU ranks: ONE msrun launch runs the cases chosen in
tests/distributed/fsdp_cases_4.py (four-way sums, other uneven shards, the gradient's scale at
W=4), with the same per-rank, per-element checks as the 2-rank launch."""
import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestFullyShardOn4Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "fsdp_cases_4.py", 4, 1500, True
