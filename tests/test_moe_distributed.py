"""Expert parallelism on real msrun ranks against the E=1 model unsharded in one process: ONE
launch per world size runs every case of tests/distributed/moe_cases.py (2 ranks: EP 2) and
tests/distributed/moe_cases_4.py (4 ranks: EP 2 x FSDP 2, EP 4, HSDP (2, 2) with EP 2)."""
import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestMoEOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "moe_cases.py", 2, 1200, True


class TestMoEOn4Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "moe_cases_4.py", 4, 1800, True
