"""The gathered-parameter memory of one ``fully_shard`` unit: the all-gathers (launched now or
prefetched), the buffers the full parameters live in, their installation into the cells, and
their release.

One buffer per parameter (:class:`gradpool.GatheredParam`, made on first use); a parameter with
nothing to gather (replicated, or a shard group of one rank) is its own full form and has none.
Installing puts each full tensor into its owning cells' ``__dict__``: an instance attribute is
found before ``Cell.__getattr__`` looks in ``_params``, so a cell's construct reads the gathered
tensor while ``trainable_params()`` stays the local shards.
"""
from __future__ import annotations

from typing import Callable, Optional

import mindspore as ms

from gradpool import GatheredParam, GradReducer, LeaseStateError
from hyper_parallel.platform.mindspore.fully_shard.order import GATHER
from hyper_parallel.platform.mindspore.fully_shard.param import (MindSporeHSDPParamV2,
                                                                  PendingGather,
                                                                  launch_all_gather)


class UnitMemory:
    """Gathers, holds, installs and releases the full parameters of one unit."""

    def __init__(self, params: list[MindSporeHSDPParamV2], reducer: GradReducer,
                 order_tag: Callable[[int], object]):
        """``order_tag(kind)``: the unit-order tag the collective carries, or None (strict mode
        agrees inside that call, before the collective launches; :mod:`.order`)."""
        self.params = params
        self.reducer = reducer
        self._order_tag = order_tag
        self._buffers: list[Optional[GatheredParam]] = [None] * len(params)
        self.prefetched: Optional[PendingGather] = None
        self._poison = reducer.pool.poison_on_release

    @property
    def gathered_bytes(self) -> int:
        """Bytes of gathered-parameter memory held now."""
        return sum(b.resident_bytes for b in self._buffers if b is not None)

    @property
    def buffers(self) -> list[Optional[GatheredParam]]:
        return list(self._buffers)

    def local_params(self) -> list:
        return [p.sharded_param for p in self.params]

    # -- gathering --------------------------------------------------------------------------------
    def gather(self, local_params) -> tuple:
        """The unit's full parameters, in its gathered buffers: with ``comm_fusion`` one
        all-gather per dtype into pool buckets (``param.launch_all_gather``), else one per
        parameter; ``comm_fusion`` governs both directions, as upstream. A gather another unit
        prefetched is waited."""
        pending, self.prefetched = self.prefetched, None
        if pending is None:
            pending = self._launch_gather(local_params)
        return pending.wait(self._fill)

    def gather_again(self) -> None:
        """Gather into the buffers released since the last gather (the tensors stay the same)."""
        self.gather(self.local_params())

    def _fill(self, index: int, full: ms.Tensor) -> ms.Tensor:
        """Entry ``index`` of a gather: written into that parameter's buffer, whose tensor is what
        the cells compute with (a gather straight into the buffer has filled it already); a
        parameter with nothing to gather is its own full form (no buffer, never released)."""
        buffer = self._buffer(index)
        if buffer is None or full is buffer.tensor:
            return full
        return buffer.fill(full)

    def _buffer(self, index: int) -> Optional[GatheredParam]:
        """Parameter ``index``'s gathered memory, made on first use; None when it has nothing to
        gather."""
        param = self.params[index]
        if param.replicate or param.world_size == 1:
            return None
        if self._buffers[index] is None:
            self._buffers[index] = GatheredParam(
                param.orig_shape, param.param_dtype or param.orig_dtype, poison=self._poison)
        return self._buffers[index]

    def _launch_gather(self, local_params) -> PendingGather:
        return launch_all_gather(self.params, list(local_params), self.reducer.pool,
                                 fused=self.reducer.config.comm_fusion,
                                 host=self.reducer.config.host_copies,
                                 buffers=[self._buffer(i) for i in range(len(self.params))],
                                 tag=self._order_tag(GATHER) if self._gathers() else None)

    def _gathers(self) -> bool:
        """Some parameter of the unit is gathered from other ranks (a collective runs)."""
        return any(not p.replicate and p.world_size > 1 for p in self.params)

    def prefetch(self) -> None:
        """Launch the all-gathers now, unless one is launched already."""
        if self.prefetched is None:
            self.prefetched = self._launch_gather(self.local_params())

    def prefetch_for_backward(self) -> None:
        """Launch the all-gathers a backward will need, unless the parameters are still gathered
        or the gather is launched already."""
        if self.prefetched is None and self.needs_gather():
            self.prefetched = self._launch_gather(self.local_params())

    def abandon_prefetch(self) -> None:
        if self.prefetched is not None:
            pending, self.prefetched = self.prefetched, None
            pending.abandon()

    def needs_gather(self) -> bool:
        """Some gathered parameter was released and not gathered again."""
        return any(b is not None and not b.valid for b in self._buffers)

    def check_valid_for_backward(self, describe: str) -> None:
        """Raise if a buffer autograd has just read was released and never gathered again."""
        for buffer in self._buffers:
            if buffer is not None and not buffer.valid:
                raise LeaseStateError(
                    f"fully_shard unit {describe}: its backward read a gathered parameter "
                    f"{buffer.shape} released after forward and not gathered again (its "
                    "backward pre-hook did not run)")

    def release(self) -> None:
        """Release the memory of every gathered parameter (the one release path for it:
        :meth:`gradpool.GatheredParam.release`, on buffers this unit made)."""
        for buffer in self._buffers:
            if buffer is not None:
                buffer.release()

    # -- installing into the cells ----------------------------------------------------------------
    def current_fulls(self) -> tuple:
        """The gathered parameters as they are now (a parameter without a buffer is its own full
        form)."""
        return tuple(p.in_param_dtype(p.sharded_param) if b is None else b.tensor
                     for p, b in zip(self.params, self._buffers))

    def install(self, fulls) -> None:
        for param, full in zip(self.params, fulls):
            for cell, attr in param.owners:
                cell.__dict__[attr] = full

    def uninstall(self) -> None:
        for param in self.params:
            for cell, attr in param.owners:
                cell.__dict__.pop(attr, None)

    def installed(self) -> bool:
        return any(attr in cell.__dict__ for p in self.params for cell, attr in p.owners)
