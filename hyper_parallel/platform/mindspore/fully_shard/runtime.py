"""What every ``fully_shard`` unit of a process shares during a step, owned by one object.

Every unit is held weakly here (by :class:`weakref.ref`): a unit belongs to its model, and a
model dropped at any point (between micro-steps, after an exception) frees its units, whose
finalizer gives their leases back to the pool.

* the registry of units (finding roots, containment, prefetch targets);
* the asynchronous reduces still in flight, in launch order (main_grad mode): at most the
  previous unit's when a unit launches its own (older ones land then), the rest at the end of
  backward;
* the shared zero gradients handed to autograd (one tensor per shape and dtype);
* the order in which units finished their forward, which gives the backward order that the
  implicit backward prefetch follows (FSDP2 does the same: the reverse of the post-forward
  order);
* whether parameters were replaced by their shards since the last forward: their memory is
  freed before the next forward starts (:meth:`FullyShardRuntime.free_replaced_parameters`);
* whether a failure path ran since the last step boundary: under torch-style backward that,
  not MindSpore's grad flag, tells an abandoned grad graph from the recording every forward
  gets (:meth:`FullyShardRuntime.close_abandoned_grad_graph`);
* the unit-order mismatch flag (:mod:`.order_flag`), read once at the end of a backward pass
  that reduced (:meth:`FullyShardRuntime.check_unit_order`).
"""
from __future__ import annotations

import gc
import logging
import weakref
from typing import Optional

import mindspore as ms
from mindspore import mint

from gradpool import device_target, return_free_host_memory
from hyper_parallel.platform.mindspore.fully_shard.autograd import (backward_engine,
                                                                     discard_open_grad_graph,
                                                                     grad_graph_open,
                                                                     in_backward,
                                                                     queue_end_of_backward,
                                                                     resume_recording,
                                                                     torch_style_recording)
from gradpool import UnsupportedPatternError
from hyper_parallel.platform.mindspore.fully_shard.order import UnitOrderCheck
from hyper_parallel.platform.mindspore.fully_shard.order_flag import OrderFlag
from hyper_parallel.platform.mindspore.fully_shard.recompute import non_reentrant_recompute

logger = logging.getLogger(__name__)

# Asynchronous reduces left in flight when the next unit launches its own: the previous unit's
# (it hides behind the launching unit's backward compute); older ones land first.
REDUCES_KEPT_IN_FLIGHT = 1


class FullyShardRuntime:
    """The shared state of this process's ``fully_shard`` units (see the module doc)."""

    def __init__(self):
        self._units: list = []                     # weakref.ref(HSDPUnitState)
        self.in_flight_refs: list = []             # units whose async reduce is not landed
        self.landing_error: Optional[BaseException] = None   # met landing early, raised at the end
        self.zeros: dict = {}                      # (shape, dtype) -> read-only zero tensor
        self.forward_order: list = []              # refs: units in the order their forward ended
        self.replaced_parameters = False           # fully_shard swapped some since the last forward
        self.backward_pass: Optional[int] = None   # engine whose end-of-backward is queued
        self.backward_units: dict = {}             # id -> ref: units that ran in that pass
        self.order_check: Optional[UnitOrderCheck] = None   # strict mode: made on first use
        self.order_flag = OrderFlag()              # the default check's per-step flag
        self.world_comm = None                     # over which a mismatch is described
        self._paths: dict = {}                     # id(unit) -> (ref, path under its root)
        self.failure_seen = False                  # a forward or backward raised since the last
        #                                            step boundary (close_abandoned_grad_graph)

    # -- registry ---------------------------------------------------------------------------------
    def register(self, unit) -> None:
        """Keep ``unit`` (weakly). No registration number: the order a process made its units
        in differs between ranks when one builds another model first (:mod:`.order` names units
        by :attr:`order_identity`)."""
        self._units.append(weakref.ref(unit))

    def unit_order_check(self, world_comm) -> UnitOrderCheck:
        if self.order_check is None:
            self.order_check = UnitOrderCheck(world_comm, self.describe_unit)
        return self.order_check

    def use_world_comm(self, world_comm) -> None:
        if self.world_comm is None or world_comm.world_size > self.world_comm.world_size:
            self.world_comm = world_comm

    def path_of(self, unit) -> str:
        """The path of ``unit``'s first module under the root unit that contains it ("" for a
        root; its class name when no root unit contains it): the same on every rank."""
        known = self._paths.get(id(unit))
        if known is not None and known[0]() is unit:
            return known[1]
        module, path = unit.modules[0], None
        for root in (u for u in self.live_units() if u.is_root):
            for top in root.modules:
                for name, cell in top.cells_and_names():
                    if cell is module:
                        path = name
                        break
        if path is None:
            path = type(module).__name__
        self._paths[id(unit)] = (weakref.ref(unit), path)
        return path

    def describe_unit(self, identity: int) -> str:
        """``'layers.1' (DecoderLayer)``: the path under its root and the class of the unit whose
        :attr:`order_identity` is ``identity`` (the same unit on every rank)."""
        units = [u for u in self.live_units() if u.params or u.is_root]
        match = [u for u in units if u.order_identity == identity]
        if not match:
            return f"#{identity}"
        unit = match[-1]
        path = self.path_of(unit)
        where = repr(path) if path else "the root"
        return f"{where} ({user_class_name(unit.modules[0])})"

    # -- the unit-order check's one host read per step --------------------------------------------
    def check_unit_order(self, units) -> None:
        """The end of a backward pass that reduced: read the mismatch flag (the one host read of
        the check, after the reduces have landed, before any optimizer update); on a mismatch,
        the gradients of ``units`` (those of the pass) are dropped and
        :class:`UnsupportedPatternError` names what each rank ran (the ranks exchange their
        recorded tags, on this path only)."""
        flag = self.order_flag
        reducing = [u for u in units if u.params]
        if not flag.pending or (reducing and all(u.reduce_path.keeps_partials for u in reducing)):
            return      # HSDP micro-steps without the replicate all-reduce: read at the last
        if not flag.read():
            flag.clear()
            return
        try:
            message = flag.describe_failure(self.world_comm, self.describe_unit)
        finally:
            flag.clear()
            for unit in units:
                unit.reduce_path.zero_grad()
        raise UnsupportedPatternError(message)

    def live_units(self) -> list:
        alive = [ref for ref in self._units if ref() is not None]
        self._units = alive
        return alive_units(alive)

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
        one is settled: no lease stays live, and nothing is added twice. A failure met by an
        earlier landing inside backward (:meth:`land_before_previous`) is raised here too."""
        error: Optional[BaseException] = None
        try:
            self._land(keep=0)
        except Exception as exc:  # noqa: BLE001 - raised below, after an earlier one
            error = exc
        earlier, self.landing_error = self.landing_error, None
        if earlier is not None or error is not None:
            raise earlier if earlier is not None else error

    def land_before_previous(self) -> None:
        """A unit is about to launch its asynchronous reduce: every reduce launched before the
        newest one in flight lands now, in launch order, so that at most two stay in flight (the
        one launched last, which keeps the running unit's backward compute to hide behind, and
        the one about to launch) and their output buckets go back to the pool as backward goes,
        not all at its end. On a device the wait is a stream wait (the pool's default bound of
        two fenced input buckets has the compute stream wait for the same collective when the
        next input is acquired); no host read. A failure is kept and raised by the next
        :meth:`finish_async_reduces` (the end of backward): every rank launches the same
        collectives, and the others land first."""
        try:
            self._land(keep=REDUCES_KEPT_IN_FLIGHT)
        except Exception as exc:  # noqa: BLE001 - raised at the end of backward
            self.landing_error = self.landing_error if self.landing_error is not None else exc

    def _land(self, keep: int) -> None:
        """Land, in launch order, every reduce in flight but the ``keep`` launched last; the
        first failure is raised once the others are landed."""
        error: Optional[BaseException] = None
        while len(self.in_flight_refs) > keep:
            unit = self.in_flight_refs[0]()
            if unit is None:       # dropped: its finalizer gave its buckets back
                del self.in_flight_refs[0]
                continue
            try:
                unit.finish_async_reduce()
            except Exception as exc:  # noqa: BLE001 - the first failure is raised below
                error = error if error is not None else exc
        if error is not None:
            raise error

    @property
    def in_flight(self) -> list:
        """The live units whose asynchronous reduce is not landed yet, in launch order."""
        return alive_units(self.in_flight_refs)

    def left_in_flight(self, unit) -> None:
        """``unit``'s backward left its reduce in flight (landed in launch order)."""
        self.in_flight_refs.append(weakref.ref(unit))

    def take_in_flight(self, unit) -> bool:
        """Take ``unit`` off the in-flight list; False when it had no reduce in flight."""
        for position, ref in enumerate(self.in_flight_refs):
            if ref() is unit:
                del self.in_flight_refs[position]
                return True
        return False

    # -- the backward pass ------------------------------------------------------------------------
    def backward_started(self, unit) -> None:
        """``unit``'s backward runs: the first unit of a backward pass queues the pass's end
        (autograd's final callback), so the step ends when autograd is done, whatever the root
        holds and whichever units the loss used; a nested engine (a reentrant recompute's inner
        backward) ends inside the outer pass, so only the outer one ends the step."""
        known = self.backward_units.get(id(unit))
        if known is None or known() is not unit:     # an id of a dropped unit may be reused
            self.backward_units[id(unit)] = weakref.ref(unit)
        if self.backward_pass is None and in_backward():
            self.backward_pass = backward_engine()
            queue_end_of_backward(self.end_backward_pass)

    def recover_from_failed_backward(self) -> None:
        """Before a forward outside backward, or at ``zero_grad``: a backward pass still recorded
        as running raised before its end (autograd runs no final callback then, e.g. a refused
        recompute); every unit goes back to rest now, as after a forward that raised (a unit
        may hold a prefetch that backward launched, or its backward's gathered parameters)."""
        if self.backward_pass is None or in_backward():
            return
        self.failure_seen = True
        logger.warning("fully_shard: the last backward raised before its end; every unit's "
                       "gathered parameters and per-step state are reset")
        self.backward_pass, self.backward_units = None, {}
        self._reset_every_unit()

    def end_backward_pass(self) -> None:
        """Every gradient of the pass is computed. Unless a unit that ran is told more
        micro-batches follow (``set_is_last_backward(False)``), the asynchronous reduces land in
        ``main_grad`` and prefetched gathers no backward used are given back; then every unit
        is settled (its gathered memory released, its per-step state at rest), and no
        parameter's torch-style ``grad`` holds the shared zeros."""
        units = alive_units(self.backward_units.values())
        self.backward_pass, self.backward_units = None, {}
        last = all(unit.settings.is_last_backward for unit in units)
        try:
            if last:
                self.abandon_prefetches()
                self.finish_async_reduces()
                self.check_unit_order(units)
        finally:
            self._drop_shared_zeros_from_grads(units)
            for unit in self.live_units():
                unit.settle_backward()
            if last:
                for pool in {id(u.reducer.pool): u.reducer.pool for u in units}.values():
                    pool.wait_all()

    def _drop_shared_zeros_from_grads(self, units) -> None:
        """A torch-style backward (``run_backward`` accumulating into each leaf's ``grad``) stores
        what a unit hands autograd as the shard's ``grad``. Where the gradient went elsewhere
        that is zeros: always in main_grad mode (the gradient is in ``main_grad``), and the
        shared zeros of a micro-step without sync (it is in the unit's buckets). Such a
        ``grad`` becomes None, as in upstream and FSDP2, and no later accumulation adds into
        the shared zeros' memory (in place, on a device that accumulates so)."""
        shared = {zeros.data_ptr() for zeros in self.zeros.values()}
        for unit in units:
            for param in unit.params:
                accumulated = param.sharded_param._grad
                if accumulated is not None and (param.use_main_grad
                                                or accumulated.data_ptr() in shared):
                    param.sharded_param._grad = None

    def reset_after_failed_forward(self, cell) -> None:
        """A forward raised inside a unit's module (caught by the caller, step skipped): every
        unit back to rest, so the next step and every later model start clean."""
        self.failure_seen = True
        logger.warning("fully_shard: the forward of %s raised; every unit's gathered parameters "
                       "and per-step state are reset", type(cell).__name__)
        self._reset_every_unit()

    def _reset_every_unit(self) -> None:
        self.forward_order = []
        self.order_flag = OrderFlag()     # the abandoned step's tags are not the next one's
        for unit in self.live_units():
            unit.forget_order_tags()
        for unit in self.live_units():
            unit.reset_after_failure()
        self.restore_cell_grad_flags()

    def close_abandoned_grad_graph(self) -> bool:
        """Between steps (``zero_grad``), a grad graph still open is one an exception left behind
        inside ``value_and_grad`` (see :mod:`.autograd`): no unit is in a forward or backward and
        autograd runs no backward, yet MindSpore records. It is discarded, so the next step
        records a graph of its own. True when one was.

        Under torch-style backward MindSpore records every forward, so the flag is open after a
        completed ``loss.backward()`` too: a graph is taken as abandoned only on evidence, a
        failure path of this runtime that ran since the last step boundary, or a recorded use of
        a unit whose backward never ran (an exception after the model, in the loss); recording
        goes on after the discard, and after MindSpore turned it off on its own."""
        self.recover_from_failed_backward()
        if in_backward():
            return False
        if not grad_graph_open():
            # nothing open; under torch-style backward MindSpore turned recording off itself
            # (a backward whose cell hook raised, a value_and_grad call): on again
            self.failure_seen = False
            resume_recording()
            return False
        units = self.live_units()
        if any(unit.in_forward or unit.in_backward_use for unit in units):
            return False
        failed, self.failure_seen = self.failure_seen, False
        if torch_style_recording() and not failed \
                and not any(unit.steps.uses_awaiting_backward for unit in units):
            return False
        logger.warning("fully_shard: a gradient computation that raised left MindSpore's grad "
                       "graph open; it is discarded before the next step")
        discard_open_grad_graph()
        for unit in units:      # the uses it recorded will never get their backward
            unit.settle_backward()
        return True

    def restore_cell_grad_flags(self) -> None:
        """MindSpore's grad of a cell (the reentrant recompute's nested grad among them) sets the
        cell's ``requires_grad`` for the call and restores it only when the call returns: a
        forward that raises leaves it True, and every later call of that cell under a grad then
        records a nested graph of its own, which gave wrong gradients to the next step (an
        unsharded net shows it too). Cells inside the units go back to False (a root module
        keeps its flag: ``set_grad()`` is set there)."""
        units = self.live_units()
        roots = {id(module) for unit in units if unit.is_root for module in unit.modules}
        for unit in units:
            for module in unit.modules:
                for _, cell in module.cells_and_names():
                    if id(cell) not in roots and cell.requires_grad:
                        cell.requires_grad = False

    # -- activation recompute ---------------------------------------------------------------------
    def check_recompute_cells(self, unit) -> None:
        """MindSpore's reentrant recompute (``Cell.recompute()``'s default) re-runs a cell under
        a nested grad that differentiates only the cell's own Parameters, so the gathered
        parameters a unit installs would get no gradient: such a cell inside a unit is switched
        to MindSpore's non-reentrant recompute (same activations recomputed), logged; checked at
        every forward use, since `Cell.recompute()` may be called at any time."""
        for module in unit.modules:
            for _, cell in module.cells_and_names():
                non_reentrant_recompute(cell)

    def abandon_prefetches(self) -> None:
        for unit in self.live_units():
            unit.abandon_prefetch()

    # -- forward order, for the implicit backward prefetch ---------------------------------------
    def forward_ended(self, unit) -> None:
        """``unit``'s forward ended. A unit ending its forward again starts a new order (the next
        step's forward)."""
        if any(seen() is unit for seen in self.forward_order):
            self.forward_order = []
        self.forward_order.append(weakref.ref(unit))

    def next_in_backward(self, unit):
        """The unit whose backward follows ``unit``'s: the one whose forward ended just before
        it; None when ``unit`` is the last (or did not run forward this step)."""
        order = alive_units(self.forward_order)
        for position, seen in enumerate(order):
            if seen is unit:
                return order[position - 1] if position > 0 else None
        return None


RUNTIME = FullyShardRuntime()


def alive_units(refs) -> list:
    """The units of ``refs`` (weak references) still alive, in order."""
    return [unit for unit in (ref() for ref in refs) if unit is not None]


def user_class_name(module) -> str:
    """The class the user wrote, not the ``HSDP<name>`` one fully_shard extends it into."""
    mro = type(module).__mro__
    if len(mro) > 2 and mro[0].__name__ == f"HSDP{mro[2].__name__}":
        return mro[2].__name__
    return mro[0].__name__
