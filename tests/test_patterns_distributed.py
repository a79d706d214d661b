"""Training patterns users write (a unit used twice, activation recompute in every MindSpore
form and ours, a forward that raises, a skipped unit, a weight read outside its unit, dynamic
shapes with a frozen parameter, dropped models) on 2 real CPU ranks with uneven shards: ONE
msrun launch runs every case of tests/distributed/pattern_cases.py, each against the unsharded
model."""
import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestPatternsOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "pattern_cases.py", 2, 1200, True


class TestPatternsOn4Ranks(SuiteTests):
    """FSDP 4 and HSDP (2, 2): tests/distributed/pattern_cases_4.py."""
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "pattern_cases_4.py", 4, 1200, True
