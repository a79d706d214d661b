"""Every rank runs the same ``fully_shard`` units in the same order: agreed before each unit's
collectives, so a unit run on some ranks only is refused by name.

Without the agreement a rank that skips a unit (data-dependent control flow, a branch on the
rank) pairs its next collective with another rank's collective of a different unit: a hang when
their sizes differ, and when they match (two identical layers) silently mixed shards. Before
each all-gather and each reduce a unit launches, every rank of the job all-gathers one number
naming the unit and the collective (a 4-byte all-gather per rank, over the world); when they
differ, every rank raises :class:`gradpool.UnsupportedPatternError` naming what each rank was
about to run. The world, not the unit's own group, agrees: a mismatch inside one shard group
must stop the ranks of the other groups too, which would otherwise wait in a collective with
the ranks that raised. ``GradPoolConfig(check_unit_order=False)`` leaves the agreement out.
"""
from __future__ import annotations

from typing import Callable

import mindspore as ms
import numpy as np
from mindspore import mint

from gradpool import UnsupportedPatternError

GATHER, REDUCE = 0, 1
_KIND_NAMES = {GATHER: "all-gather", REDUCE: "reduce"}
# Tags travel as float32 (the collective dtype every backend has): exact below 2 ** 24.
UNIT_SLOTS = 1 << 22


def tag_of(unit_index: int, kind: int) -> int:
    """The number a rank sends for the collective ``kind`` of unit ``unit_index`` (never 0)."""
    return (unit_index % UNIT_SLOTS) * 2 + kind + 1


def unit_and_kind(tag: int) -> tuple[int, int]:
    """Inverse of :func:`tag_of` (the unit index modulo the number of slots)."""
    return (tag - 1) // 2, (tag - 1) % 2


def disagreement_message(tags: list[int], describe: Callable[[int], str]) -> str:
    """What each rank was about to run, one clause per distinct collective."""
    clauses = []
    for tag in dict.fromkeys(tags):
        ranks = [rank for rank, other in enumerate(tags) if other == tag]
        unit, kind = unit_and_kind(tag)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        clauses.append(f"{who} at the {_KIND_NAMES[kind]} of unit {describe(unit)}")
    return ("fully_shard units ran in a different order on the ranks: " + "; ".join(clauses)
            + ". Every rank must run the same fully_shard units in the same order (a unit "
            "skipped or run an extra time on some ranks only pairs its collectives with another "
            "unit's: a hang or mixed shards); run the unit on every rank (e.g. on an empty or "
            "zero-weighted batch). The step is abandoned on every rank; the model is reset")


class UnitOrderCheck:
    """The agreement of one process's units over ``comm`` (the world communicator)."""

    def __init__(self, comm, describe: Callable[[int], str]):
        self.comm = comm
        self.describe = describe

    def agree(self, unit_index: int, kind: int) -> None:
        """Every rank is about to run collective ``kind`` of unit ``unit_index``; else every
        rank raises :class:`UnsupportedPatternError` saying what each was about to run."""
        if self.comm.world_size == 1:
            return
        send = ms.Tensor(np.array([tag_of(unit_index, kind)], np.float32))
        received = mint.zeros(self.comm.world_size, dtype=ms.float32)
        self.comm.all_gather(received, send).wait()
        tags = [int(value) for value in received.asnumpy()]
        if any(tag != tags[0] for tag in tags):
            raise UnsupportedPatternError(disagreement_message(tags, self.describe))
