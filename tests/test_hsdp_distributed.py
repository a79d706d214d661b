"""HSDP on 4 real CPU ranks: ONE msrun launch runs every case of tests/distributed/hsdp_cases.py
(mesh (2, 2): reduce-scatter in the shard group, all-reduce across the replicas), each a test."""
import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestHsdpOn4Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "hsdp_cases.py", 4, 900, True
