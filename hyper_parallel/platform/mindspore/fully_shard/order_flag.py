"""The default unit-order check on the device (see :mod:`.order` for the encoding): the tag a
unit collective carries, the comparison after it, the per-step mismatch flag, and its one host
read per step.

The flag is a float32 tensor of one element, 0 while every tagged collective agreed and 1 once
one did not; every comparison updates it with queued device ops (``maximum``), never read on the
host until :meth:`OrderFlag.read`. Each tagged bucket also carries the sender's flag in its flag
slot, summed (reduce) or gathered with the rest: a mismatch one group of ranks saw reaches the
ranks of every group its later collectives cross (HSDP: the replicate all-reduce carries it, so a
mismatch inside one shard group stops the other groups too).

On the host each rank only records which tags it sent (a list of ints); the failure path alone
exchanges those lists over the world to say what each rank ran.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import mindspore as ms
from mindspore import mint, ops

from gradpool import UnsupportedPatternError, exchange_ints
from hyper_parallel.platform.mindspore.fully_shard.order import (FLAG_SLOT, REDUCE, TAG_BITS,
                                                                 TAG_NUMEL, disagreement_message,
                                                                 tag_slots)

logger = logging.getLogger(__name__)

# Tags recorded per rank between two reads (a bound for forward-only loops that never read).
MAX_RECORDED = 1 << 16


class OrderFlag:
    """This process's mismatch flag and the tags it sent since the last read."""

    def __init__(self):
        self._flag: Optional[ms.Tensor] = None   # None: nothing compared since the last read
        self.recorded: list[int] = []
        self.reduced = False                     # a tagged reduce ran since the last read
        self._zeros: dict = {}

    # -- what a tagged collective sends -----------------------------------------------------------
    def sent(self, tag: int, reduce: bool) -> None:
        """Record that this rank launched the collective ``tag``."""
        if len(self.recorded) < MAX_RECORDED:
            self.recorded.append(tag)
        self.reduced = self.reduced or reduce

    def slot_value(self, dtype) -> ms.Tensor:
        """What this rank writes in a bucket's flag slot: its flag (0 or 1), in ``dtype``."""
        if self._flag is None:
            zeros = self._zeros.get(dtype)
            if zeros is None:
                zeros = self._zeros[dtype] = mint.zeros((1,), dtype=dtype)
            return zeros
        return self._flag.astype(dtype) if dtype != ms.float32 else self._flag

    # -- comparisons (queued device ops) ----------------------------------------------------------
    def check_reduced(self, sums: ms.Tensor) -> None:
        """``sums``: a reduced tail (sums or averages over the ranks of what each sent). A pair
        whose two sums are both nonzero, or a nonzero flag slot, is a mismatch."""
        sums = sums.astype(ms.float32) if sums.dtype != ms.float32 else sums
        # slices only: an int index failed in MindSpore 2.10's getitem after a discarded grad
        # graph ("Only support integers ... but got 48 with type <class 'int'>")
        pairs = sums[:FLAG_SLOT].reshape(TAG_BITS, 2)
        both = ops.minimum(pairs[:, 0:1], pairs[:, 1:2]).sum() + sums[FLAG_SLOT:].sum()
        self._raise_to(both)

    def check_gathered(self, rows: ms.Tensor, own: ms.Tensor) -> None:
        """``rows``: every rank's tail of an all-gather (``[W, TAG_NUMEL]``); ``own``: the tag
        values this rank sent (float32). A row whose pairs differ from ``own``, or a nonzero flag
        slot, is a mismatch."""
        rows = rows.astype(ms.float32) if rows.dtype != ms.float32 else rows
        differ = mint.abs(rows[:, :FLAG_SLOT] - own[:FLAG_SLOT]).sum() + rows[:, FLAG_SLOT:].sum()
        self._raise_to(differ)

    def _raise_to(self, evidence: ms.Tensor) -> None:
        seen = (evidence > 0).astype(ms.float32).reshape(1)
        self._flag = seen if self._flag is None else mint.maximum(self._flag, seen)

    # -- the one host read per step ---------------------------------------------------------------
    @property
    def pending(self) -> bool:
        """A tagged reduce ran since the last read (the step is to be read at its end)."""
        return self.reduced and self._flag is not None

    def read(self) -> bool:
        """The step's verdict: True when some tagged collective disagreed. The one host read of
        the check (it waits for the comparisons queued so far); the flag starts over."""
        flag, self._flag, self.reduced = self._flag, None, False
        return flag is not None and bool(read_order_flag(flag))

    def clear(self) -> None:
        """Forget the recorded tags (after a read, or a step given up)."""
        self.recorded = []

    def describe_failure(self, world_comm, describe: Callable[[int], str]) -> str:
        """The failure path: every rank's recorded tags, exchanged over ``world_comm`` (two
        small all-reduces, only here), and the first collective where they differ."""
        sequences = exchange_sequences(world_comm, self.recorded)
        longest = max(len(seq) for seq in sequences)
        for position in range(longest):
            at = [seq[position] if position < len(seq) else None for seq in sequences]
            if any(tag != at[0] for tag in at):
                return disagreement_message(at, describe)
        return ("fully_shard units' collectives carried different unit tags on the ranks (the "
                "ranks' own records agree: a rank outside this process's shard groups, or a hash "
                "collision). The step is abandoned on every rank; the model is reset")


def read_order_flag(flag: ms.Tensor) -> float:
    """The host read of the flag (named, so a count of host reads can tell it apart)."""
    return float(flag.asnumpy()[0])


def exchange_sequences(world_comm, recorded: list[int]) -> list[list[int]]:
    """Every rank's ``recorded`` tags (:func:`gradpool.exchange_ints`: the lengths, then the
    tags padded to the longest)."""
    if world_comm.world_size == 1:
        return [list(recorded)]
    sizes = [int(n) for n in exchange_ints(world_comm, [len(recorded)])[:, 0]]
    width = max(max(sizes), 1)
    mine = list(recorded) + [-1] * (width - len(recorded))
    rows = exchange_ints(world_comm, mine)
    return [[int(tag) for tag in row[:size]] for row, size in zip(rows, sizes)]


class UnitTag:
    """What one unit collective carries: the tag's values in a bucket row's tail, and the
    comparison after the collective (satisfies :class:`gradpool.reducer.RowTag`)."""

    numel = TAG_NUMEL

    def __init__(self, flag: OrderFlag, tag: int):
        self.flag = flag
        self.tag = tag
        self._slots = tag_slots(tag)
        self._constants: dict = {}

    def _constant(self, dtype) -> ms.Tensor:
        constant = self._constants.get(dtype)
        if constant is None:
            constant = self._constants[dtype] = ms.Tensor(self._slots[:FLAG_SLOT]).astype(dtype)
        return constant

    def values(self, dtype) -> ms.Tensor:
        """The pairs, then this rank's flag, in ``dtype`` (``TAG_NUMEL`` elements): called once
        per tagged collective, as it is launched (so it is recorded here)."""
        self.flag.sent(self.tag, reduce=self.tag % 2 == REDUCE)
        return mint.cat([self._constant(dtype), self.flag.slot_value(dtype)])

    def check_reduced(self, tail: ms.Tensor) -> None:
        self.flag.check_reduced(tail)

    def check_gathered(self, rows: ms.Tensor) -> None:
        self.flag.check_gathered(rows, self._constant(ms.float32))
