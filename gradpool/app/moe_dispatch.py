"""The all-to-all token dispatcher for Ascend: each routed (token, expert) row goes only to the
EP rank holding that expert, over ``mindspore.mint.distributed.all_to_all_single`` (documented
for Ascend only: no CPU kernel, so this path is guarded by the device target and not run here).

The bookkeeping is NumPy, free of MindSpore, and tested on CPU by simulating the exchange
(``tests/test_moe.py``):

* :func:`plan_send` (source side): the routed pairs of this rank's N tokens, ordered by
  destination EP rank, then by expert, then by token; the rows to send, their experts, the
  count per destination (``input_split_sizes``) and per (destination, expert);
* :func:`plan_receive` (destination side): from the per-expert counts each source sends first,
  the count per source (``output_split_sizes``) and, per local expert, where its rows sit in
  the received buffer (source-major, expert-minor).

A step: exchange the [E, n] per-expert counts (one small all-to-all), send the token rows, run
each local expert on its received rows (unweighted), send the outputs back with the split sizes
swapped, and on the source scale each by its routing weight and scatter-add into its token's
row. The backward of an all-to-all is the all-to-all with the split sizes swapped.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from gradpool.errors import InvalidArgumentError

ENV = "GRADPOOL_MOE_DISPATCH"          # "all_to_all" picks this dispatcher (Ascend only)


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


def all_to_all_requested() -> bool:
    """``GRADPOOL_MOE_DISPATCH=all_to_all``: refused off Ascend, where MindSpore has no
    all-to-all kernel; anything else (or unset) keeps the all-gather dispatcher."""
    choice = os.environ.get(ENV, "all_gather")
    if choice not in ("all_gather", "all_to_all"):
        raise InvalidArgumentError(f"{ENV}={choice!r}: use all_gather or all_to_all")
    if choice == "all_gather":
        return False
    from gradpool.device import device_target
    if device_target() != "Ascend":
        raise InvalidArgumentError(
            f"{ENV}=all_to_all needs Ascend (mint.distributed.all_to_all_single has no CPU "
            f"kernel); this process runs on {device_target()}: unset {ENV}")
    return True


class AllToAllDispatcher:      # pragma: no cover - Ascend only (no NPU in this project's CI)
    """The all-to-all dispatcher (module doc); same call as the all-gather one."""

    def __init__(self, ep):
        self.ep = ep

    def _exchange_function(self, out_rows, in_rows):
        from mindspore import mint
        from mindspore.common._grad_function import _Function
        from mindspore.mint.distributed import all_to_all_single
        group = self.ep.group

        def exchange(x, receive, send):
            out = mint.zeros((int(sum(receive)),) + tuple(x.shape[1:]), dtype=x.dtype)
            all_to_all_single(out, x.contiguous(), [int(c) for c in receive],
                              [int(c) for c in send], group=group)
            return out

        class Exchange(_Function):
            @staticmethod
            def forward(ctx, x):
                return exchange(x, out_rows, in_rows)

            @staticmethod
            def backward(ctx, grad):
                return exchange(grad, in_rows, out_rows)

        return Exchange

    def __call__(self, experts, flat, weights):
        import mindspore as ms
        from mindspore import Tensor, mint, ops
        from mindspore.mint.distributed import all_to_all_single

        send = plan_send(weights.asnumpy(), self.ep.size)
        local = experts.indices
        counts = mint.zeros((self.ep.size * len(local),), dtype=ms.int32)
        all_to_all_single(counts, Tensor(send.per_expert.reshape(-1).astype(np.int32)),
                          group=self.ep.group)
        receive = plan_receive(counts.asnumpy().reshape(self.ep.size, len(local)), local)
        there = self._exchange_function(receive.counts, send.counts).apply(
            ops.gather(flat, Tensor(send.rows), 0))
        mask = np.zeros((there.shape[0], weights.shape[1]), np.float32)
        for g, positions in receive.positions.items():
            mask[positions, g] = 1.0           # one expert per received row: unweighted output
        outputs = experts(there, Tensor(mask, dtype=flat.dtype))
        back = self._exchange_function(send.counts, receive.counts).apply(outputs)
        scale = ops.gather_nd(weights, Tensor(np.stack([send.rows, send.experts], axis=1)))
        return ops.unsorted_segment_sum(back * scale.reshape(-1, 1).astype(back.dtype),
                                        Tensor(send.rows), flat.shape[0])
