"""Every rank runs the same ``fully_shard`` units in the same order: a unit run on some ranks only
is refused by name.

Without a check a rank that skips or swaps a unit (data-dependent control flow, a branch on the
rank) pairs its next collective with another rank's collective of a different unit: a hang when
their sizes differ, and when they match (two identical layers) silently mixed shards.

**What identifies a collective** (:func:`unit_identity`, :func:`tag_of`): a hash of the unit's
module path under its root model, its class and its parameters' names and shapes, plus the kind
of collective (all-gather or reduce). Every rank computes the same tag for the same unit, however
many other sharded models a process built before (an evaluation copy, a teacher).

**The default check rides inside the unit's own collectives** (:mod:`.order_flag`): each tag is
sent as ``TAG_BITS`` pairs of values ``(bit, 1 - bit)``; the sender's mismatch flag (0, or how many
collectives disagreed) is added to both values of the last pair. In an all-gather every rank's row arrives as sent, so each rank compares every row
with its own; in a reduce (sum or average) every rank writes its pairs into every row, and a pair
whose two sums are both nonzero proves two ranks sent different bits (sums of values >= 0 are
zero only when all are: no rounding can hide it, in any float dtype at any world size). The
comparison runs on the device into a per-step flag that the host reads once, at the end of the
backward pass; a mismatch raises :class:`gradpool.UnsupportedPatternError` there, naming what
each rank ran (only then do the ranks exchange their recorded tags). It costs no collective and
no host read per unit. It finds every mismatch whose collectives complete (the silent mixing);
one that hangs (different sizes) needs the strict mode.

**Strict mode** (``check_unit_order="strict"``, :class:`UnitOrderCheck`): before each all-gather
and each reduce, every rank of the job exchanges the tag over the world (one small all-reduce,
:func:`gradpool.exchange_ints`) and reads it on the host, so a mismatch is refused before the collective that would hang. A world collective and a
host wait per unit collective: for hunting a hang, not for training.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional, Sequence

import numpy as np

from gradpool import UnsupportedPatternError, exchange_ints

GATHER, REDUCE = 0, 1
_KIND_NAMES = {GATHER: "all-gather", REDUCE: "reduce"}
# A unit's identity: IDENTITY_BITS bits of a hash; a tag adds the kind. Each tag bit costs two
# elements of a bucket row's tail, so the tag is kept short (a collision needs two different units
# at the same collective with equal 23-bit hashes).
IDENTITY_BITS = 23
TAG_BITS = IDENTITY_BITS + 1
# The values a tag takes in a bucket row: TAG_BITS pairs (bit, 1 - bit). The sender's flag rides
# on both values of the last pair rather than in a slot of its own: the device comparison is then
# one min over pairs (reduce) or one sum of differences (all-gather), a few ops per collective.
TAG_NUMEL = 2 * TAG_BITS


def unit_identity(path: str, class_name: str, params: Sequence[tuple[str, tuple]]) -> int:
    """A number every rank computes alike for the same unit: from its module path under its root
    model, its class and its parameters' ``(name, shape)``, never from how many units a process
    made."""
    text = "\n".join([path, class_name] + [f"{name}:{tuple(shape)}" for name, shape in params])
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (1 << IDENTITY_BITS)


def tag_of(identity: int, kind: int) -> int:
    """The number a rank sends for the collective ``kind`` of the unit ``identity``."""
    return (identity % (1 << IDENTITY_BITS)) * 2 + kind


def unit_and_kind(tag: int) -> tuple[int, int]:
    """Inverse of :func:`tag_of`."""
    return tag // 2, tag % 2


def tag_slots(tag: int) -> np.ndarray:
    """The ``TAG_NUMEL`` values (float32) a tag is sent as with no flag raised: ``(bit, 1 - bit)``
    per bit, low bit first."""
    bits = np.array([(tag >> b) & 1 for b in range(TAG_BITS)], np.float32)
    slots = np.zeros(TAG_NUMEL, np.float32)
    slots[0::2], slots[1::2] = bits, 1 - bits
    return slots


def flag_mask() -> np.ndarray:
    """Where the sender's flag is added to a tag's values: both values of the last pair (a flag
    > 0 makes both of that pair's sums nonzero in a reduce, and a gathered row differ)."""
    mask = np.zeros(TAG_NUMEL, np.float32)
    mask[-2:] = 1
    return mask


def disagreement_message(tags: list[Optional[int]], describe: Callable[[int], str]) -> str:
    """What each rank ran, one clause per distinct collective (None: the rank ran no further unit
    collective)."""
    clauses = []
    for tag in dict.fromkeys(tags):
        ranks = [rank for rank, other in enumerate(tags) if other == tag]
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
        if tag is None:
            clauses.append(f"{who} at no further unit collective")
            continue
        unit, kind = unit_and_kind(tag)
        clauses.append(f"{who} at the {_KIND_NAMES[kind]} of unit {describe(unit)}")
    return ("fully_shard units ran in a different order on the ranks: " + "; ".join(clauses)
            + ". Every rank must run the same fully_shard units in the same order (a unit "
            "skipped or run an extra time on some ranks only pairs its collectives with another "
            "unit's: a hang or mixed shards); run the unit on every rank (e.g. on an empty or "
            "zero-weighted batch). The step is abandoned on every rank; the model is reset")


class UnitOrderCheck:
    """Strict mode: the blocking agreement of one process's units over ``comm`` (the world)."""

    def __init__(self, comm, describe: Callable[[int], str]):
        self.comm = comm
        self.describe = describe

    def agree(self, tag: int) -> None:
        """Every rank is about to run the collective ``tag``; else every rank raises
        :class:`UnsupportedPatternError` saying what each was about to run."""
        if self.comm.world_size == 1:
            return
        tags = [int(value) for value in exchange_ints(self.comm, [tag])[:, 0]]
        if any(tag != tags[0] for tag in tags):
            raise UnsupportedPatternError(disagreement_message(tags, self.describe))
