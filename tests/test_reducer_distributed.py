"""GradReducer on 2 real CPU ranks: ONE msrun launch runs every case in
tests/distributed/reducer_cases.py (reduce-scatter and all-reduce against NumPy for every op,
reduce dtype, gradient dtype and bucketing; accumulation; zero-copy; fences under delayed
completion; wait() failures; two fully_shard cases under the asynchronous launch), and each
case is a test here."""
import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestReducerOn2Ranks(SuiteTests):
    # MindSpore's default launch: the asynchronous queues stay covered on real ranks
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "reducer_cases.py", 2, 400, False
