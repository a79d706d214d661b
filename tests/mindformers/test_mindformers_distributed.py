"""mindformers' own apply_fsdp on msrun ranks: ONE launch per world size runs every case of
tests/mindformers/mf_cases.py (2 ranks: FSDP; 4 ranks: HSDP 2 x 2 through mindformers'
``data_parallel_shard: 2``)."""
from pathlib import Path

import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed
CASES = str(Path(__file__).resolve().parent / "mf_cases.py")


class TestMindformersOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = CASES, 2, 1500, True


class TestMindformersOn4Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = CASES, 4, 2400, True
