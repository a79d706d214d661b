"""The two all-to-alls the all-to-all token dispatcher needs, over one EP group:

* ``counts(per_expert [E, n]) -> [E, n]``: equal splits, row ``d`` of this rank's table to EP
  rank ``d``; row ``s`` of the result is what EP rank ``s`` sent here;
* ``rows(x, send [E], receive [E]) -> Tensor``: ``all_to_all_single`` of token rows with split
  sizes: the first ``send[0]`` rows of ``x`` to EP rank 0, the next ``send[1]`` to rank 1, ...;
  the result holds ``receive[s]`` rows from each source ``s``, in source order.

Both backends take and give at least one row: ``x`` may carry a padding row past its
``sum(send)`` rows (when that sum is 0) and the result ends with one zero row when
``sum(receive)`` is 0, so no tensor of the dispatcher has zero rows and a rank that receives no
token still runs its experts (on the padding row, weight zero) and enters every collective.

:func:`exchange_for` picks by the device target: Ascend's ``mint.distributed.all_to_all_single``
(:class:`AscendAllToAll`, HCCL), and everywhere else :class:`GatheredAllToAll`, a **stand-in**
built from the all-gather the CPU backend has, so the dispatcher's autograd, its counts exchange
and its bookkeeping run on CPU ranks under msrun (tests/distributed/moe_cases*.py). The stand-in
moves every rank's whole send buffer to every rank (E times an all-to-all's bytes, and one more
small all-gather of the split sizes per exchange): a test vehicle, not a performance model.
"""
from __future__ import annotations

import logging

import mindspore as ms
import numpy as np
from mindspore import Tensor, mint

from gradpool.errors import CommError

logger = logging.getLogger(__name__)


def exchange_for(ep):
    """The all-to-all of ``ep``'s group for this process's device (module doc)."""
    from gradpool.device import device_target
    if device_target() == "Ascend":
        return AscendAllToAll(ep.group)
    logger.info("all-to-all token dispatch on %s runs through a stand-in built from all-gathers "
                "(%d times the bytes of an all-to-all)", device_target(), ep.size)
    return GatheredAllToAll(ep.comm)


def _with_padding_row(rows: Tensor, count: int) -> Tensor:
    """``rows`` when ``count > 0``, else one zero row of its width and dtype (module doc)."""
    if count > 0:
        return rows
    return mint.zeros((1,) + tuple(rows.shape[1:]), dtype=rows.dtype)


class GatheredAllToAll:
    """The CPU stand-in for ``all_to_all_single`` (module doc), over a
    :class:`gradpool.comm.Communicator` of the EP group. It also checks what a real all-to-all
    cannot: that each source's split size for each destination equals that destination's
    receive count (a counts exchange gone wrong would hang or misplace rows on Ascend; here
    every rank raises the same CommError)."""

    def __init__(self, comm):
        self.comm = comm

    def _gathered(self, values: np.ndarray) -> np.ndarray:
        """[E, *values.shape]: every EP rank's ``values``, as float32 on the wire (the CPU
        collectives carry floating point only; counts and float32/bfloat16 rows are exact)."""
        flat = np.ascontiguousarray(values, dtype=np.float32).reshape(-1)
        out = mint.zeros((self.comm.world_size * flat.size,), dtype=ms.float32)
        self.comm.all_gather(out, Tensor(flat)).wait()
        return out.asnumpy().reshape((self.comm.world_size,) + values.shape)

    def counts(self, per_expert: np.ndarray) -> np.ndarray:
        tables = self._gathered(per_expert)                  # [source, destination, n]
        return np.rint(tables[:, self.comm.rank]).astype(np.int64)

    def rows(self, x: Tensor, send, receive) -> Tensor:
        send, receive = np.asarray(send, np.int64), np.asarray(receive, np.int64)
        # every rank's split sizes, both ways, in one gather: all ranks check the same tables
        # and so raise together, rather than one raising while the others wait in a collective
        splits = np.rint(self._gathered(np.stack([send, receive]))).astype(np.int64)
        sent, expected = splits[:, 0], splits[:, 1].T              # [source, destination]
        if not np.array_equal(sent, expected):
            wrong = [(int(s), int(d)) for s, d in zip(*np.nonzero(sent != expected))]
            raise CommError(
                f"all-to-all stand-in: split sizes disagree for (source, destination) EP ranks "
                f"{wrong}: sent {[int(sent[p]) for p in wrong]} rows, expected "
                f"{[int(expected[p]) for p in wrong]}; the counts exchange and the split sizes "
                "disagree")
        me = self.comm.rank
        width = int(np.prod(x.shape[1:]))
        padded = np.zeros((max(int(sent.sum(axis=1).max()), 1), width), np.float32)
        total = int(send.sum())
        if total:
            padded[:total] = x[:total].astype(ms.float32).asnumpy().reshape(total, width)
        buffers = self._gathered(padded)                     # [source, longest, width]
        starts = np.cumsum(sent, axis=1)[:, me] - receive     # where our block begins
        got = np.concatenate([buffers[s, starts[s]:starts[s] + receive[s]]
                              for s in range(len(receive))])
        if not got.shape[0]:
            return _with_padding_row(x, 0)
        return Tensor(got.reshape((-1,) + tuple(x.shape[1:])), dtype=ms.float32).astype(x.dtype)


class AscendAllToAll:     # pragma: no cover - Ascend only (no NPU here); the stand-in above runs
    """``mint.distributed.all_to_all_single`` over HCCL group ``group`` (module doc)."""

    def __init__(self, group):
        self.group = group

    def counts(self, per_expert: np.ndarray) -> np.ndarray:
        from mindspore.mint.distributed import all_to_all_single
        out = mint.zeros((per_expert.size,), dtype=ms.int32)
        all_to_all_single(out, Tensor(per_expert.reshape(-1).astype(np.int32)), group=self.group)
        return out.asnumpy().reshape(per_expert.shape).astype(np.int64)

    def rows(self, x: Tensor, send, receive) -> Tensor:
        from mindspore.mint.distributed import all_to_all_single
        total, expected = int(np.sum(send)), int(np.sum(receive))
        out = mint.zeros((expected,) + tuple(x.shape[1:]), dtype=x.dtype)
        all_to_all_single(out, x[:total].contiguous(), [int(c) for c in receive],
                          [int(c) for c in send], group=self.group)
        return _with_padding_row(out, expected)
