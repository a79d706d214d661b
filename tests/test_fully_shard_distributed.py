"""fully_shard end to end on 2 real CPU ranks: ONE msrun launch runs every case of
tests/distributed/fsdp_cases.py. Each case checks, per rank and per element, the reduced shard
gradients and main_grad (after one and after several micro-steps) against the unsharded
reference's gradient chunks, then trains against it (see that file)."""
import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestFullyShardOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "fsdp_cases.py", 2, 1500, True
