"""The fully_shard cases chosen for the 4-rank launch (tests/test_fully_shard_distributed_4.py).

A 4-rank launch on the 2-core machine costs ~20 s to start and each case about twice its 2-rank
CPU time (measured: 3 cases, 330 CPU-seconds over the 4 ranks, 5.5 min on the loaded machine), so
it runs the two cases world size 4 adds most to: four-way sums (the collective's own summation
order, hence the measured W=4 tolerances), shards uneven in a new way (vocab 67 -> chunks of 17,
the last rank's 16), accumulation (the probe) and the gradient's scale (avg divides by 4: every
probe comparison would be 4x off), in float32 and in bfloat16. The plain-SGD case runs at W=2.
The definitions are those of fsdp_cases.py.
"""
from __future__ import annotations

import mindspore as ms

import fsdp_cases
from harness import Suite

CASES = ("field_configuration", "reduce_in_bfloat16")

suite = Suite("fully_shard_4", blocking_launch=True)
for _name in CASES:
    suite.add(_name, fsdp_cases.suite.cases[_name])


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
