"""The controls of one ``fully_shard`` unit that ``HSDPModule``'s setters change, in one record
that the unit's parts (its step state machine, its reduce path) read."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class UnitSettings:
    reshard_after_forward: bool
    reshard_after_backward: bool = True
    requires_sync: bool = True             # False: micro-steps accumulate, nothing is reduced
    requires_all_reduce: bool = True       # HSDP: False skips the replicate all-reduce
    is_last_backward: bool = True          # the root's backward ends the step
    gradient_scaling_factor: float = 1.0
    reduce_op: str = "avg"
    gradient_divide_factor: Optional[float] = None   # set: reduce with a sum, then divide by it
