"""What every ``fully_shard`` unit of a process shares during a step, owned by one object.

* the registry of units (weak references: finding roots, containment, prefetch targets);
* the asynchronous reduces still in flight, in launch order (main_grad mode);
* the shared zero gradients handed to autograd (one tensor per shape and dtype);
* the order in which units finished their forward, which gives the backward order that the
  implicit backward prefetch follows (FSDP2 does the same: the reverse of the post-forward
  order);
* whether parameters were replaced by their shards since the last forward: their memory is
  freed before the next forward starts (:meth:`FullyShardRuntime.free_replaced_parameters`).
"""
from __future__ import annotations

import gc
import weakref
from typing import Optional

import mindspore as ms
from mindspore import mint

from gradpool import device_target, return_free_host_memory


class FullyShardRuntime:
    """The shared state of this process's ``fully_shard`` units (see the module doc)."""

    def __init__(self):
        self._units: list = []                     # weakref.ref(HSDPUnitState)
        self.in_flight: list = []                  # units whose async reduce is not in main_grad
        self.zeros: dict = {}                      # (shape, dtype) -> read-only zero tensor
        self.forward_order: list = []              # units in the order their forward ended
        self.replaced_parameters = False           # fully_shard swapped some since the last forward

    # -- registry ---------------------------------------------------------------------------------
    def register(self, unit) -> None:
        self._units.append(weakref.ref(unit))

    def live_units(self) -> list:
        alive = [ref for ref in self._units if ref() is not None]
        self._units = alive
        return [ref() for ref in alive]

    # -- the parameters fully_shard replaced ----------------------------------------------------
    def free_replaced_parameters(self) -> None:
        """Free the full parameters ``fully_shard`` replaced with shards, once, before a forward.

        They are garbage once replaced, but a MindSpore ``Parameter`` and its ``ParamInfo``
        refer to each other, so only the cycle collector frees them: without this, a model's
        worth of full parameters stays until Python's collector happens to run. One collection
        for every ``fully_shard`` call before the first forward (a collection per call would
        cost one per layer). On CPU the freed parameters are host memory, handed back to the OS
        too."""
        if not self.replaced_parameters:
            return
        self.replaced_parameters = False
        gc.collect()
        if device_target() == "CPU":
            return_free_host_memory()

    # -- shared zeros -----------------------------------------------------------------------------
    def shared_zeros(self, shape: tuple, dtype) -> ms.Tensor:
        """One zero tensor per (shape, dtype), for every parameter whose real gradient goes
        elsewhere (no allocation per step). Nothing writes into it."""
        key = (tuple(shape), dtype)
        zeros = self.zeros.get(key)
        if zeros is None:
            zeros = self.zeros[key] = mint.zeros(key[0], dtype=dtype)
        return zeros

    # -- asynchronous reduces ---------------------------------------------------------------------
    def finish_async_reduces(self) -> None:
        """Wait for every asynchronous reduce still in flight and add it into ``main_grad``, in
        launch order (the same on every rank). A failed collective is raised once every other
        one is settled: no lease stays live, and nothing is added twice."""
        error: Optional[BaseException] = None
        while self.in_flight:
            try:
                self.in_flight[0].finish_async_reduce()
            except Exception as exc:  # noqa: BLE001 - the first failure is raised below
                error = error if error is not None else exc
        if error is not None:
            raise error

    def abandon_prefetches(self) -> None:
        for unit in self.live_units():
            unit.abandon_prefetch()

    # -- forward order, for the implicit backward prefetch ---------------------------------------
    def forward_ended(self, unit) -> None:
        """``unit``'s forward ended. A unit ending its forward again starts a new order (the next
        step's forward)."""
        if any(seen is unit for seen in self.forward_order):
            self.forward_order = []
        self.forward_order.append(unit)

    def next_in_backward(self, unit):
        """The unit whose backward follows ``unit``'s: the one whose forward ended just before
        it; None when ``unit`` is the last (or did not run forward this step)."""
        order = self.forward_order
        for position, seen in enumerate(order):
            if seen is unit:
                return order[position - 1] if position > 0 else None
        return None


RUNTIME = FullyShardRuntime()
