"""The all-to-all token dispatcher: each routed (token, expert) row goes only to the EP rank
holding that expert, over the all-to-alls of :mod:`gradpool.app.moe_exchange`
(``mindspore.mint.distributed.all_to_all_single`` on Ascend; on CPU a stand-in built from the
all-gather CPU has, so this dispatcher runs on msrun ranks in tests/distributed/moe_cases*.py),
which a run uses by ``model.moe_dispatcher`` (:mod:`gradpool.app.dispatchers`).

The bookkeeping is NumPy, free of MindSpore (``tests/test_moe.py`` also checks it against a
simulated exchange):

* :func:`plan_send` (source side): the routed pairs of this rank's N tokens, ordered by
  destination EP rank, then by expert, then by token; the rows to send, their experts, the
  count per destination (``input_split_sizes``) and per (destination, expert);
* :func:`plan_receive` (destination side): from the per-expert counts each source sends first,
  the count per source (``output_split_sizes``) and, per local expert, where its rows sit in
  the received buffer (source-major, expert-minor).

A step: exchange the [E, n] per-expert counts (one small all-to-all), send the token rows, run
each local expert on its received rows (unweighted), send the outputs back with the split sizes
swapped, and on the source scale each by its routing weight and scatter-add into its token's
row. The backward of an all-to-all is the all-to-all with the split sizes swapped. A rank that
receives no row runs its experts on one zero padding row (see moe_exchange), so its expert unit
takes part in the step as on every other rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mindspore import Tensor, ops
from mindspore.common._grad_function import _Function

from gradpool.errors import InvalidArgumentError

@dataclass(frozen=True)
class SendPlan:
    rows: np.ndarray          # [S] token index of each sent row, in send order
    experts: np.ndarray       # [S] global expert of each sent row
    counts: np.ndarray        # [E] rows sent to each EP rank (input_split_sizes)
    per_expert: np.ndarray    # [E, n] rows sent to each EP rank's each local expert


@dataclass(frozen=True)
class ReceivePlan:
    counts: np.ndarray        # [E] rows received from each EP rank (output_split_sizes)
    positions: dict           # local expert (global index) -> its rows' positions, ascending


def plan_send(weights: np.ndarray, ep_size: int) -> SendPlan:
    """The send order for routing ``weights`` [N, num_experts] (non-zero: routed)."""
    tokens, num_experts = weights.shape
    if ep_size < 1 or num_experts % ep_size:
        raise InvalidArgumentError(f"plan_send: expert parallelism {ep_size} does not divide "
                                   f"num_experts = {num_experts}")
    expert_of, token_of = np.nonzero(weights.T != 0)     # expert-major, tokens ascending
    per_expert = np.bincount(expert_of, minlength=num_experts).reshape(ep_size, -1)
    return SendPlan(rows=token_of.astype(np.int32), experts=expert_of.astype(np.int32),
                    counts=per_expert.sum(axis=1), per_expert=per_expert)


def plan_receive(received_counts: np.ndarray, local: range) -> ReceivePlan:
    """``received_counts`` [E sources, n]: what each source's :func:`plan_send` sent this
    rank's local experts (``per_expert[this rank]`` of each source)."""
    received_counts = np.asarray(received_counts)
    if received_counts.ndim != 2 or received_counts.shape[1] != len(local):
        raise InvalidArgumentError(
            f"plan_receive: counts of shape {received_counts.shape}, expected [sources, "
            f"{len(local)}] for local experts {list(local)}")
    positions = {g: [] for g in local}
    at = 0
    for source in received_counts:
        for g, count in zip(local, source):
            positions[g].append(np.arange(at, at + count, dtype=np.int32))
            at += int(count)
    return ReceivePlan(counts=received_counts.sum(axis=1),
                       positions={g: np.concatenate(p) for g, p in positions.items()})


class AllToAllDispatcher:
    """The all-to-all dispatcher (module doc); same call as the all-gather one."""

    def __init__(self, ep, exchange=None):
        from gradpool.app.moe_exchange import exchange_for
        self.ep = ep
        self.exchange = exchange if exchange is not None else exchange_for(ep)

    def _moved(self, send, receive):
        """An autograd function sending the rows of its input by ``send`` and receiving by
        ``receive``; its backward sends the gradient back with the two swapped."""
        exchange = self.exchange

        class Moved(_Function):
            @staticmethod
            def forward(ctx, x):
                return exchange.rows(x, send, receive)

            @staticmethod
            def backward(ctx, grad):
                return exchange.rows(grad, receive, send)

        return Moved

    def __call__(self, experts, flat: Tensor, weights: Tensor) -> Tensor:
        send = plan_send(weights.asnumpy(), self.ep.size)
        local = experts.indices
        received = self.exchange.counts(send.per_expert)            # [sources, n]
        receive = plan_receive(received, local)
        rows = Tensor(send.rows)
        # a routed token has a non-zero weight (its largest top-k softmax weight is >= 1/k), so
        # every rank sends at least one row per token: only the receiving side can be empty
        there = self._moved(send.counts, receive.counts).apply(ops.gather(flat, rows, 0))
        mask = np.zeros((there.shape[0], weights.shape[1]), np.float32)
        for g, positions in receive.positions.items():
            mask[positions, g] = 1.0           # one expert per received row: unweighted output
        outputs = experts(there, Tensor(mask, dtype=flat.dtype))
        back = self._moved(receive.counts, send.counts).apply(outputs)
        scale = ops.gather_nd(weights, Tensor(np.stack([send.rows, send.experts], axis=1)))
        return ops.unsorted_segment_sum(back * scale.reshape(-1, 1).astype(back.dtype), rows,
                                        flat.shape[0])
