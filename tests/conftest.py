import os
import sys

sys.path.insert(0, os.path.dirname(__file__))   # tests/ helpers (npref, simulated, ...)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "distributed"))   # harness, cases

import pytest

# The shared checks in tests/ helper modules report their failures as test modules do.
pytest.register_assert_rewrite("bad_inputs", "pool_checks")


@pytest.fixture(autouse=True)
def _launch_stays_asynchronous():
    """Blocking op launch is process-wide and cannot be undone: a test that turned it on in this
    process would make every later test in it run synchronously, where a missing wait for
    MindSpore's launch queue can no longer show."""
    yield
    if "mindspore" in sys.modules:
        from gradpool.device import launches_blocking
        assert not launches_blocking(), \
            "this test left the process launching ops blocking; run it with " \
            "launch.launch_blocking=false or in a subprocess"


@pytest.fixture(scope="class")
def suite_results(request, tmp_path_factory):
    """One msrun launch of a :class:`suite_tests.SuiteTests` class's cases script."""
    return request.cls.launch(tmp_path_factory)
