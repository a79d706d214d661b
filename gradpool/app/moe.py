"""Expert parallelism for the tiny model's MoE: the local experts and the all-gather dispatcher.

With ``model.expert_parallel = E > 1`` the ranks form EP groups of E consecutive ranks; EP rank
``p`` (= world rank % E) holds experts ``[p * n, (p + 1) * n)`` of every MoE layer
(``n = num_experts / E``), under their global names (``layers.<i>.moe.experts.<j>.gate``), with
the values the E=1 model draws for them. A layer's step on one rank:

1. route its own N tokens (the router is a dense weight, the same on every rank), giving routing
   weights [N, num_experts] with exactly k non-zero per token, the same decisions as the E=1
   model's;
2. **dispatch**: all-gather the tokens and their routing weights over the EP group
   ([E*N, H + num_experts], rank-major);
3. compute each local expert on the gathered rows routed to it, and only those (gather the rows,
   run the SwiGLU, scale by the routing weight, scatter-add back into [E*N, H]): sparse, so a
   rank's expert FLOPs are its experts' share of the group's routed (token, expert) pairs,
   ``k * N`` on average, against ``num_experts * N`` for the dense all-experts product of E=1;
4. **combine**: reduce-scatter (sum) the [E*N, H] partial outputs over the EP group, so each
   rank gets its own N rows summed over every expert that holds one of them.

Autograd: the backward of the all-gather is a reduce-scatter (sum) of its gradient, the backward
of the reduce-scatter an all-gather (:func:`dispatcher_functions`), so a local expert's gradient
is summed over the whole EP group's tokens, and the router's flows back to the rank whose tokens
it routed. Its expert unit then reduces over the expert-data-parallel ranks (the W/E ranks with
the same experts) and divides by W, not W/E (``set_gradient_divide_factor``), so expert and
dense gradients are averages over the same global batch.

It runs on the collectives CPU has (an all-reduce-built reduce-scatter, all-gather). The
all-to-all dispatcher (:mod:`gradpool.app.moe_dispatch`, Ascend's default) sends each routed row
only to the rank holding its expert; ``model.moe_dispatcher`` picks (:func:`dispatcher_for`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
from mindspore import Tensor, mint, nn, ops
from mindspore.common._grad_function import _Function

from gradpool.app.dispatchers import AUTO, resolve_dispatcher
from gradpool.errors import InvalidArgumentError


@dataclass
class ExpertParallel:
    """This rank's place in its EP group: ``size`` ranks (E), this one EP rank ``rank``, and
    ``comm`` the group's :class:`gradpool.comm.Communicator` (world size ``size``)."""

    size: int
    rank: int
    comm: object = field(repr=False)
    group: Optional[str] = None       # the MindSpore group name (the all-to-all dispatcher's)

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise InvalidArgumentError(f"ExpertParallel: size must be an integer >= 1, got "
                                       f"{self.size!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) \
                or not 0 <= self.rank < self.size:
            raise InvalidArgumentError(f"ExpertParallel: rank must be an integer in "
                                       f"[0, {self.size}), got {self.rank!r}")
        world = getattr(self.comm, "world_size", None)
        if world != self.size:
            raise InvalidArgumentError(
                f"ExpertParallel: the EP communicator spans {world} ranks, not size "
                f"{self.size}; pass the communicator of this rank's EP group")


def local_experts(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The global indices of the experts EP rank ``ep_rank`` of ``ep_size`` holds."""
    if num_experts % ep_size:
        raise InvalidArgumentError(
            f"expert parallelism {ep_size} does not divide num_experts = {num_experts}; choose "
            "a divisor of num_experts")
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def routed_rows(weights: np.ndarray, experts) -> dict:
    """{global expert: the rows of ``weights`` [M, num_experts] routed to it}. A row is routed
    to the experts where its routing weight is non-zero: the top-k softmax gives exactly zero
    elsewhere, and a selected expert whose weight underflowed to zero adds exactly zero to the
    output and to every gradient, so leaving it out changes nothing."""
    return {int(g): np.flatnonzero(weights[:, g] != 0).astype(np.int32) for g in experts}


@dataclass
class ExpertWork:
    """What the local experts computed in their last forward: routed rows per global expert,
    and padding rows (one per local expert no row was routed to, see LocalExperts)."""

    rows: dict = field(default_factory=dict)
    padding: int = 0

    @property
    def routed(self) -> int:
        return sum(self.rows.values())


class LocalExperts(nn.Cell):
    """This EP rank's experts of one MoE layer, each under its global index (the child named
    ``str(j)``), so parameter names match the E=1 model's. Its own ``fully_shard`` unit.

    ``construct(tokens [M, H], weights [M, num_experts]) -> [M, H]``: the sum over the local
    experts of ``weight * expert(token)`` for the rows routed to each, zero for other rows.

    A local expert no row was routed to runs on one row with weight zero (its gradient is then
    exactly zero): every local parameter takes part in every step's graph, so the unit's
    backward (and its reduce over the expert-data-parallel ranks, which the other ranks of that
    group enter) runs on every rank whatever the routing."""

    def __init__(self, experts: dict):
        super().__init__()
        self.indices = sorted(experts)
        for index in self.indices:
            self.insert_child_to_cell(str(index), experts[index])
        self.last = ExpertWork()

    def expert(self, index: int):
        return self._cells[str(index)]

    def construct(self, tokens: Tensor, weights: Tensor) -> Tensor:
        rows = routed_rows(weights.asnumpy(), self.indices)
        self.last = ExpertWork(rows={g: int(r.size) for g, r in rows.items()})
        outputs, places = [], []
        for index in self.indices:
            picked, scale = rows[index], None
            if picked.size == 0:
                picked, scale = np.zeros(1, np.int32), 0.0
                self.last.padding += 1
            at = Tensor(picked)
            weight = ops.gather(weights[:, index:index + 1], at, 0)             # [n, 1]
            if scale is not None:
                weight = weight * scale
            outputs.append(self.expert(index)(ops.gather(tokens, at, 0)) * weight)
            places.append(picked)
        # one scatter-add for all local experts, rows in expert order: a row's terms add in
        # ascending expert order, as the E=1 model's sum over its expert axis does
        return ops.unsorted_segment_sum(mint.cat(outputs), Tensor(np.concatenate(places)),
                                        tokens.shape[0])


def dispatcher_functions(comm):
    """(Gather, Combine): autograd functions over ``comm``'s group of E ranks.

    ``Gather.apply(x [N, C]) -> [E*N, C]``, every rank's rows in rank order; its backward
    reduce-scatters (sums) the gradient back to each rank's own N rows.
    ``Combine.apply(y [E*N, C]) -> [N, C]``, the sum over ranks of this rank's block of rows;
    its backward all-gathers the gradient. Every rank of the group must call them in the same
    order with the same N (the EP group's ranks have the same batch shape)."""
    world = comm.world_size

    def all_gather(x: Tensor) -> Tensor:
        rows, cols = x.shape
        out = mint.zeros((world * rows * cols,), dtype=x.dtype)
        comm.all_gather(out, x.reshape(-1)).wait()
        return out.reshape(world * rows, cols)

    def reduce_scatter(y: Tensor) -> Tensor:
        rows, cols = y.shape
        out = mint.zeros((rows // world * cols,), dtype=y.dtype)
        comm.reduce_scatter(out, y.reshape(-1), op="sum").wait()
        return out.reshape(rows // world, cols)

    class Gather(_Function):
        @staticmethod
        def forward(ctx, x):
            return all_gather(x)

        @staticmethod
        def backward(ctx, grad):
            return reduce_scatter(grad)

    class Combine(_Function):
        @staticmethod
        def forward(ctx, y):
            return reduce_scatter(y)

        @staticmethod
        def backward(ctx, grad):
            return all_gather(grad)

    return Gather, Combine


class AllGatherDispatcher:
    """Tokens and routing to every rank of the EP group, partial outputs back (module doc)."""

    def __init__(self, ep: ExpertParallel):
        self.ep = ep
        self._gather, self._combine = dispatcher_functions(ep.comm)

    def __call__(self, experts: LocalExperts, flat: Tensor, weights: Tensor) -> Tensor:
        hidden = flat.shape[-1]
        # one collective for both: CPU collectives cost milliseconds per call
        gathered = self._gather.apply(mint.cat([flat, weights.astype(flat.dtype)], dim=1))
        partial = experts(gathered[:, :hidden], gathered[:, hidden:])
        return self._combine.apply(partial)


def dispatcher_for(ep: Optional[ExpertParallel], choice: str = AUTO):
    """The dispatcher of ``model.moe_dispatcher = choice`` on this device
    (:func:`gradpool.app.dispatchers.resolve_dispatcher`: ``auto`` is the all-to-all one on
    Ascend, the all-gather one elsewhere); None without expert parallelism."""
    if ep is None:
        return None
    from gradpool.device import device_target
    if resolve_dispatcher(choice, device_target()) == "all-to-all":
        from gradpool.app.moe_dispatch import AllToAllDispatcher
        return AllToAllDispatcher(ep)
    return AllGatherDispatcher(ep)


__all__ = ["ExpertParallel", "LocalExperts", "AllGatherDispatcher", "ExpertWork",
           "local_experts", "routed_rows", "dispatcher_for", "dispatcher_functions"]
