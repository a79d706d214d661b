"""Expert parallelism on 4 msrun ranks (tests/test_moe_distributed.py), against the E=1 model
unsharded in one process, as moe_cases.py: EP 2 x FSDP 2 (experts sharded over 2 EDP ranks,
unevenly: expert_hidden 23), EP 4 (8 experts, two per rank, no EDP sharding), and HSDP (2, 2)
with EP 2 (dense weights replicate x shard, experts 1-D FSDP over their 2 EDP ranks). The
all-to-all dispatcher at EP 4 (EP rank 2 routed no token) and EP 2 x FSDP 2 (EP rank 0 of both
EP groups, ranks 0 and 2, routed no token), each also against the all-gather dispatcher; and
the stand-in exchange itself."""
from __future__ import annotations

import sys
from pathlib import Path

import mindspore as ms

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/: npref

from harness import Suite
from moe_cases import (Run, add_cases, all_to_all_stand_in, names_and_initial_values,
                       routed_rows_match_reference, wrong_factor_caught)

suite = Suite("moe_4", blocking_launch=True)

add_cases(suite, "ep2_fsdp2", Run(ep=2), ("plain", "main_async"))
add_cases(suite, "ep4", Run(ep=4, experts=8), ("plain", "main_async"))
add_cases(suite, "hsdp_2x2_ep2", Run(ep=2, mesh=(2, 2)), ("plain", "main_async"))
add_cases(suite, "ep4_all_to_all_rank2_starved",
          Run(ep=4, experts=8, dispatcher="all-to-all", starve=2), ("plain",))
add_cases(suite, "ep2_fsdp2_all_to_all_rank0_starved",
          Run(ep=2, dispatcher="all-to-all", starve=0), ("main_async",))
suite.case(all_to_all_stand_in)
suite.add("ep2_fsdp2_wrong_divide_factor_is_caught",
          lambda ctx: wrong_factor_caught(ctx, Run(ep=2)))
suite.add("hsdp_2x2_ep2_wrong_divide_factor_is_caught",
          lambda ctx: wrong_factor_caught(ctx, Run(ep=2, mesh=(2, 2))))
suite.add("ep4_routed_rows_match_reference",
          lambda ctx: routed_rows_match_reference(ctx, Run(ep=4, experts=8)))
suite.add("ep2_fsdp2_names_and_initial_values",
          lambda ctx: names_and_initial_values(ctx, Run(ep=2)))


if __name__ == "__main__":
    ms.set_device("CPU")
    suite.main()
