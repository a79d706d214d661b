"""The fully_shard cases chosen for the 4-rank launch (tests/test_fully_shard_distributed_4.py).

A 4-rank launch on the 2-core machine costs ~20 s to start and each case ~3-4x its 2-rank time,
so it runs the cases that world size 4 adds most to: four-way sums (another summation order),
shards uneven in a new way (vocab 67 -> chunks of 17, the last rank 16 rows), accumulation and
the gradient's scale (avg divides by 4). The definitions are those of fsdp_cases.py.
"""
from __future__ import annotations

import mindspore as ms

import fsdp_cases
from harness import Suite

CASES = ("field_configuration", "reduce_in_bfloat16", "sgd_losses_see_the_gradient_scale")

suite = Suite("fully_shard_4")
for _name in CASES:
    suite.add(_name, fsdp_cases.suite.cases[_name])


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
