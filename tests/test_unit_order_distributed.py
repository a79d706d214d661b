"""The unit-order check carried in the units' own collectives, on 2 real CPU ranks: ONE msrun
launch runs every case of tests/distributed/order_cases.py (identity across processes that built
other models, swapped units refused, the strict mode, host reads per step)."""
import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestUnitOrderOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "order_cases.py", 2, 900, True
