"""The training patterns of pattern_cases.py on 4 msrun ranks (tests/test_patterns_distributed.py):
activation recompute in each form, a unit used twice and a forward that raised, with every rank
in one shard group (FSDP 4) and on an HSDP (2, 2) mesh, resharding on and off, against the same
model unsharded. Every dimension is odd, so each shard group pads."""
from __future__ import annotations

import sys
from pathlib import Path

import mindspore as ms

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import Suite
from pattern_cases import Run, add_cases as add_both_entries, pool_memory_never_leaves_the_pool


def add_cases(into, name, run, modes):
    """value_and_grad only at 4 ranks: torch-style backward runs every case at 1 and 2 ranks."""
    add_both_entries(into, name, run, modes, entries=("value_and_grad",))

suite = Suite("patterns_4", blocking_launch=True)
MODES = ("plain", "main_async")

for mesh, tag in (((), "fsdp4"), ((2, 2), "hsdp")):
    add_cases(suite, f"{tag}_recompute_before_fully_shard", Run(recompute="before", mesh=mesh),
              MODES)
    add_cases(suite, f"{tag}_recompute_non_reentrant_kept_gathered",
              Run(recompute="after_nonreentrant", mesh=mesh, reshard=False), MODES)
    add_cases(suite, f"{tag}_recompute_functional", Run(pattern="recompute_fn", mesh=mesh),
              ("main_async",))
    add_cases(suite, f"{tag}_recompute_checkpoint_wrapper", Run(recompute="wrapper", mesh=mesh),
              ("plain",))
    add_cases(suite, f"{tag}_unit_applied_twice", Run(pattern="twice", mesh=mesh), MODES)
    add_cases(suite, f"{tag}_unit_skipped_on_one_rank_only",
              Run(skip_b_on_last_rank_at=(1,), mesh=mesh), ("plain", "main_async"))
    add_cases(suite, f"{tag}_forward_raised_and_reentrant_recompute_refused",
              Run(fail_before=("a", "loss", "reentrant_recompute"), mesh=mesh), ("main_async",))

suite.add("hsdp_pool_memory_never_leaves_the_pool",
          lambda ctx: pool_memory_never_leaves_the_pool(ctx, mesh=(2, 2)))


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
