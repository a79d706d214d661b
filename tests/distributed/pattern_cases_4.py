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
from hyper_parallel import init_device_mesh
import order_cases
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


def _hsdp_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "fsdp"))


# the unit-order check (order_cases.py): a swap inside one shard group stops the other group too
for _mode in MODES:
    suite.add(f"hsdp_units_swapped_in_one_shard_group_refused_{_mode}",
              lambda ctx, mode=_mode: order_cases.swap_case(ctx, mode, False, mesh=_hsdp_mesh()))


suite.add("hsdp_gather_tag_differs_in_one_shard_group_refused",
          lambda ctx: order_cases.gather_carries_another_units_tag(ctx, mesh=_hsdp_mesh()))


def hsdp_host_reads_in_a_training_step(ctx) -> dict:
    """order_cases.host_reads_in_a_training_step on the HSDP (2, 2) mesh."""
    checks = {}
    for label, case in order_cases.HSDP_READ_CASES.items():
        checks.update(order_cases.read_checks(
            label, order_cases.host_reads_per_step(ctx, case, mesh=_hsdp_mesh())))
    return checks


suite.add("hsdp_host_reads_in_a_training_step", hsdp_host_reads_in_a_training_step)
suite.add("hsdp_host_reads_in_a_training_step_with_clipping",
          lambda ctx: order_cases.clipped_steps(ctx, mesh=_hsdp_mesh()))


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
