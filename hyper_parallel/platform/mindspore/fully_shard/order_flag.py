"""The default unit-order check on the device (see :mod:`.order` for the encoding): the tag a
unit collective carries, the comparison after it, the per-step mismatch flag, and its one host
read per step.

The flag is a 0-d float32 tensor counting the tagged collectives that disagreed (0 while all
agreed); every comparison adds to it with queued device ops (the sign of its evidence), never read
on the host until :meth:`OrderFlag.read`. Each tagged bucket also carries the sender's flag, added
to both values of the tag's last pair, summed (reduce) or gathered with the rest: a mismatch one
group of ranks saw reaches the ranks of every group its later collectives cross (HSDP: the
replicate all-reduce carries it, so a mismatch inside one shard group stops the other groups too).
A count, not a sum of evidence: a flag of at least 1 stays representable once averaged over
thousands of ranks in float16.

On the host each rank only records which tags it sent (a list of ints); the failure path alone
exchanges those lists over the world to say what each rank ran.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import mindspore as ms
from mindspore import mint

from gradpool import UnsupportedPatternError, exchange_ints
from hyper_parallel.platform.mindspore.fully_shard.order import (REDUCE, TAG_BITS, TAG_NUMEL,
                                                                 disagreement_message, flag_mask,
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

    # -- what a tagged collective sends -----------------------------------------------------------
    def sent(self, tag: int, reduce: bool) -> None:
        """Record that this rank launched the collective ``tag``."""
        if len(self.recorded) < MAX_RECORDED:
            self.recorded.append(tag)
        self.reduced = self.reduced or reduce

    @property
    def value(self) -> Optional[ms.Tensor]:
        """The flag (0-d float32, on the device) or None while nothing was compared."""
        return self._flag

    # -- comparisons (queued device ops) ----------------------------------------------------------
    def check_reduced(self, sums: ms.Tensor) -> None:
        """``sums``: a reduced tail (sums or averages over the ranks of what each sent). A pair
        whose two sums are both nonzero is a mismatch (or a sender's raised flag)."""
        # float32: MindSpore's CPU ReduceMin has no bfloat16 kernel
        sums = sums.astype(ms.float32) if sums.dtype != ms.float32 else sums
        self._raise_to(mint.amin(sums.reshape(TAG_BITS, 2), 1).sum())

    def check_gathered(self, rows: ms.Tensor, own: ms.Tensor) -> None:
        """``rows``: every rank's tail of an all-gather (``[W, TAG_NUMEL]``); ``own``: the tag
        values this rank sent with no flag raised (float32). A row that differs from ``own`` is
        a mismatch (or a sender's raised flag)."""
        rows = rows.astype(ms.float32) if rows.dtype != ms.float32 else rows
        self._raise_to(mint.abs(rows - own).sum())

    def _raise_to(self, evidence: ms.Tensor) -> None:
        seen = mint.sign(evidence)      # evidence >= 0: 1 when this collective disagreed, else 0
        self._flag = seen if self._flag is None else mint.add(self._flag, seen)

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
    return float(flag.asnumpy().reshape(-1)[0])


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

    _mask: Optional[ms.Tensor] = None      # flag_mask(), float32, made once per process

    def __init__(self, flag: OrderFlag, tag: int):
        self.flag = flag
        self.tag = tag
        self._constants: dict = {ms.float32: ms.Tensor(tag_slots(tag))}

    def _constant(self, dtype) -> ms.Tensor:
        constant = self._constants.get(dtype)
        if constant is None:
            constant = self._constants[dtype] = self._constants[ms.float32].astype(dtype)
        return constant

    def values(self, dtype) -> ms.Tensor:
        """The pairs, this rank's flag added to the last one, in ``dtype`` (``TAG_NUMEL``
        elements): called once per tagged collective, as it is launched (so it is recorded
        here)."""
        self.flag.sent(self.tag, reduce=self.tag % 2 == REDUCE)
        flag = self.flag.value
        if flag is None:
            return self._constant(dtype)
        if UnitTag._mask is None:
            UnitTag._mask = ms.Tensor(flag_mask())
        values = mint.add(self._constants[ms.float32], mint.mul(UnitTag._mask, flag))
        return values.astype(dtype) if dtype != ms.float32 else values

    def check_reduced(self, tail: ms.Tensor) -> None:
        self.flag.check_reduced(tail)

    def check_gathered(self, rows: ms.Tensor) -> None:
        self.flag.check_gathered(rows, self._constants[ms.float32])
