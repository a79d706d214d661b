"""Training patterns (tests/distributed/pattern_cases.py) at world size 1, in this process: the
values against the unsharded model where a shard is the whole parameter (the 2-rank launch,
tests/test_patterns_distributed.py, is where uneven shards and real collectives are)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))

import harness          # noqa: E402
import pattern_cases    # noqa: E402


@pytest.mark.parametrize("name", pattern_cases.suite.names)
def test_pattern_at_world_size_1(name, tmp_path):
    pattern_cases.suite.main([str(tmp_path), name])     # outside msrun: single process
    results = harness.load_results(tmp_path, pattern_cases.suite.name, nproc=1)
    results.verify(name)
