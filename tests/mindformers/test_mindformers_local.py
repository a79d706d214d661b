"""mindformers' own apply_fsdp at world size 1, in this process: every case of
tests/mindformers/mf_cases.py (the same cases run on 2 and 4 msrun ranks in
test_mindformers_distributed.py)."""
import pytest

import mf_cases
from harness import Context, _verify_check


@pytest.mark.parametrize("name", [n for n in mf_cases.suite.names
                                  if n not in mf_cases.MULTI_RANK_ONLY])
def test_case_at_world_size_1(name):
    from gradpool.comm import communicator_for
    checks = mf_cases.suite.cases[name](Context(rank=0, world_size=1, comm=communicator_for()))
    assert checks, f"case {name} returned no checks"
    for check_name, check in checks.items():
        _verify_check(f"{name}: {check_name}", check)
