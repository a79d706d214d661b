"""Meta-device init and mindformers' meshes on real CPU ranks: one msrun launch at 2 ranks
(tests/distributed/meshmeta_cases.py: meta init against initialising then sharding, uneven
shards; ParallelDims' FSDP, HSDP 2 x 1 and EP 2 meshes) and one at 4
(tests/distributed/meshmeta_cases_4.py: HSDP 2 x 2, EP, HSDP + EP meshes; peak memory of meta
init against the model's size). The ParallelDims cases run when mindformers is installed."""
import importlib.util

import pytest

from suite_tests import SuiteTests

pytestmark = pytest.mark.distributed


class TestMeshMetaOn2Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "meshmeta_cases.py", 2, 900, True


class TestMeshMetaOn4Ranks(SuiteTests):
    SCRIPT, NPROC, TIMEOUT, BLOCKING = "meshmeta_cases_4.py", 4, 1200, True


from installed import mindformers_installed


@pytest.mark.skipif(mindformers_installed(),
                    reason="mindformers is installed: its ParallelDims cases run above")
def test_parallel_dims_cases_need_mindformers():
    pytest.skip("mindformers is not installed: the ParallelDims mesh cases did not run "
                "(make mindformers installs it)")
