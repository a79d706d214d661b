"""mindformers' own gradient norm and clipping (``_calculate_global_grad_norm``, from the installed
mindformers 2.1.0) on fully_shard's DTensors: one msrun launch at 2 ranks (1-D mesh, uneven
shards) and one at 4 ranks (HSDP (2, 2)) run tests/distributed/mindformers_norm_cases.py."""
import pytest

from suite_tests import SuiteTests

pytest.importorskip("mindformers.pynative", reason="mindformers 2.1.0 is installed by `make mindformers`")
pytestmark = pytest.mark.distributed


class TestMindformersNormOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "mindformers_norm_cases.py", 2, 600, True


class TestMindformersNormOn4RanksHsdp(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "mindformers_norm_cases.py", 4, 900, True
