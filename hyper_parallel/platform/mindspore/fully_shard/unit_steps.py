"""The per-step state machine of one ``fully_shard`` unit: its forward and backward hooks, the
uses of the unit awaiting their backward, activation recompute, reads from outside the unit,
and the two ways back to rest (the end of a backward pass, a forward that raised).

It decides *when*; the unit's memory (:mod:`.unit_memory`) gathers and releases, and its reduce
path (:mod:`.unit_reduce`) reduces. Parameter memory across a step
(``reshard_after_forward=True``, every unit but a root):

* forward: the pre-forward hook gathers the unit's parameters into its
  :class:`gradpool.GatheredParam` buffers (or waits on a forward prefetch); the forward
  hook, once every module of the unit ran, releases their memory. Autograd keeps the tensor
  objects, not their bytes.
* backward: the backward pre-hook (it runs when the gradient of the unit's output is ready,
  before the unit's own ops' backward) gathers them again into the same tensors, without
  bumping their version, then launches the all-gather of the next unit in backward order
  (the one whose forward ended just before, or ``set_modules_to_backward_prefetch``'s),
  so it runs while this unit computes. The unit's backward (the gather function's) reduces
  the gradients and, with ``reshard_after_backward`` (default), releases the memory again.

So a rank holds the gathered parameters of the running unit, of at most one prefetched unit,
and of the root (which keeps its parameters from forward to backward, as in FSDP2, since its
backward starts right after its forward ends).
"""
from __future__ import annotations

import weakref

import mindspore as ms
from mindspore import mint
from mindspore.common._grad_function import _Function

from gradpool import SUPPORTED_DTYPES, UnsupportedPatternError
from hyper_parallel.platform.mindspore.fully_shard.autograd import (grad_recorded, in_backward,
                                                                     replaying_forward)


def make_gather_function(steps: "UnitSteps"):
    """The custom autograd function every forward use of the unit passes its local shards
    through: forward gathers the full parameters, backward reduces their gradients. It holds
    ``steps`` weakly: a class is always in a reference cycle (freed by the collector only), and
    must not keep a dropped unit alive."""
    steps = weakref.ref(steps)

    class UnitGather(_Function):
        @staticmethod
        def forward(ctx, *local_params):
            return steps().memory.gather(local_params)

        @staticmethod
        def backward(ctx, *grads):
            return steps().on_backward(grads)

    return UnitGather


class UnitSteps:
    """Hooks and per-step state of one unit (see the module doc). ``unit`` is the
    :class:`.state.HSDPUnitState` front: the runtime and other units know it."""

    def __init__(self, unit):
        self._unit = weakref.ref(unit)       # the unit owns its steps
        self.memory = unit.memory
        self.reduce_path = unit.reduce_path
        self.settings = unit.settings
        self._gather = make_gather_function(self)
        # One reset path each: settle_backward at the end of each backward pass,
        # reset_after_failure when a forward raised.
        self._forwarded: set[int] = set()     # modules of this unit run since the last gather
        self._post_ran: set[int] = set()      # modules whose post-forward hook ran this call
        self.gathered = False                 # a forward use is under way (gathered, installed)
        self.in_backward_use = False          # the backward pre-hook ran, the backward has not
        self.uses_awaiting_backward = 0       # recorded forward uses whose backward has not run
        self._outside_uses = 0                # ... of them, reads from outside the unit
        self._installed_for_backward = False  # the backward pre-hook installed the gathered

    @property
    def unit(self):
        return self._unit()

    @property
    def runtime(self):
        return self.unit.runtime

    @property
    def params(self) -> list:
        return self.unit.params

    def _describe(self) -> str:
        return str([type(m).__name__ for m in self.unit.modules])

    # -- forward ----------------------------------------------------------------------------------
    def pre_forward(self, cell, inputs):
        if not self.params:
            # nothing to gather: only "a forward of this unit is under way", for outside reads
            if not in_backward() and not replaying_forward():
                self.gathered = True
            return None
        self.runtime.free_replaced_parameters()
        if replaying_forward():
            self._prepare_recompute()
        elif in_backward():
            self._refuse_reentrant_recompute(cell)
        elif not self.gathered:
            self._begin_forward_use()
        dtype = self.unit.mp_policy.param_dtype
        if dtype is not None and self.unit.mp_policy.cast_forward_inputs:
            return tuple(cast_floating(x, dtype) for x in inputs)
        return None

    def _gather_use(self) -> tuple:
        """One recorded use: the local shards through the gather function (its backward is this
        use's reduce)."""
        fulls = self._gather.apply(*self.memory.local_params())
        return tuple(fulls) if isinstance(fulls, (tuple, list)) else (fulls,)

    def _begin_forward_use(self) -> None:
        """One use of the unit starts: one gather for the whole unit, at the first of its
        modules to run, so its backward receives every module's gradients at once. A unit run
        again in the same forward (weight reuse) gathers again: each use is its own autograd
        node, whose backward reduces that use's gradients (autograd sums the uses)."""
        self.runtime.recover_from_failed_backward()
        # every use: Cell.recompute() may be switched on at any time, e.g. between steps
        self.runtime.check_recompute_cells(self.unit)
        self.memory.install(self._gather_use())
        self.gathered = True
        self.in_backward_use = False
        if grad_recorded():
            self.uses_awaiting_backward += 1
        for unit in self.unit.forward_prefetch:
            unit.prefetch()

    def _refuse_reentrant_recompute(self, cell) -> None:
        """A forward inside backward that is not a non-reentrant replay: MindSpore's reentrant
        recompute (``mindspore.recompute(cell, ...)`` with its default ``use_reentrant=True``, or
        ``Cell.recompute()`` on a cell around this unit) re-running the cell under a nested grad
        of that cell's own Parameters, the local shards: the gathered parameters the cell
        computes with would get no gradient."""
        self.runtime.restore_cell_grad_flags()
        raise UnsupportedPatternError(
            f"fully_shard: {type(cell).__name__} (a module of the unit {self._describe()}) was "
            "run again inside backward by MindSpore's reentrant recompute, whose nested grad "
            "cannot reach the parameters the unit gathers; use mindspore.recompute(..., "
            "use_reentrant=False), Cell.recompute() on a cell inside the unit, or "
            "hyper_parallel.core.activation_checkpoint.checkpoint")

    def _prepare_recompute(self) -> None:
        """A forward run inside backward (activation recompute): the cells read the gathered
        parameters this backward holds (gathered again only if released: the backward pre-hook
        or a prefetch usually did it), and nothing is gathered as a new use, resharded or
        prefetched: the recomputed forward only rebuilds activations, and autograd sends its
        gradients through the original use's gather."""
        if self.memory.needs_gather():
            self.memory.gather_again()
        self._install_for_backward()

    def _install_for_backward(self) -> None:
        if not self.memory.installed():
            self.memory.install(self.memory.current_fulls())
            self._installed_for_backward = True

    def post_forward(self, cell, inputs, outputs):
        self._post_ran.add(id(cell))
        if not replaying_forward():   # a recomputed forward keeps all for the backward under way
            self._end_forward_module(cell)
        dtype = self.unit.mp_policy.output_dtype
        if dtype is None:
            return None
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(cast_floating(x, dtype) for x in outputs)
        return cast_floating(outputs, dtype)

    def _end_forward_module(self, cell) -> None:
        self._forwarded.add(id(cell))
        if len(self._forwarded) == len(self.unit.modules):   # every module of the unit has run
            self._forwarded.clear()
            self.gathered = False
            if self.settings.reshard_after_forward:
                self.memory.uninstall()
            if self.params:
                self.runtime.forward_ended(self.unit)
                # a forward run inside backward (a reentrant recompute's inner forward) is
                # followed at once by its own backward: keep the memory for it
                # nor while a read from outside the unit awaits its backward (no backward
                # pre-hook gathers for it)
                if self.unit.reshards_after_forward and not in_backward() \
                        and not self._outside_uses:
                    self.memory.release()

    def after_forward_call(self, cell, inputs, outputs):
        """Runs after every forward of one of the unit's modules, also one that raised (then
        ``post_forward`` did not run): a failed forward resets every unit of the process."""
        if id(cell) in self._post_ran:
            self._post_ran.discard(id(cell))
            return None
        if not in_backward():      # a recompute's early stop raises by design, inside backward
            self.runtime.reset_after_failed_forward(cell)
        return None

    def read_outside(self, param) -> ms.Tensor:
        """``param`` read by a cell while its unit is not running (a root computing with a
        child's weight: a tie across units): the unit is gathered for this read as one more use
        of it, so the read sees the full parameter and its gradient reaches this unit's reduce
        (and ``main_grad``) through the use's own backward; the memory stays until then."""
        index = self.params.index(param)
        if replaying_forward():
            self._prepare_recompute()
            return self.memory.current_fulls()[index]
        fulls = self._gather_use()
        if grad_recorded():
            self.uses_awaiting_backward += 1
            self._outside_uses += 1
        return fulls[index]

    def prefetch(self) -> None:
        """Launch this unit's all-gathers now (another unit's forward started), unless they are
        launched or done already; its own forward then waits on them."""
        if self.gathered or not self.params:
            return
        self.memory.prefetch()

    # -- backward ---------------------------------------------------------------------------------
    def pre_backward(self, cell, grad_output):
        """Before the unit's ops' backward: its parameters gathered again (released after
        forward) and installed (a recompute forward reads them), then the next unit's gather
        launched (once per backward for a list unit)."""
        self.runtime.backward_started(self.unit)
        if self.memory.needs_gather():
            self.memory.gather_again()
        self._install_for_backward()
        if self.in_backward_use:
            return None
        self.in_backward_use = True
        for unit in self._backward_prefetch_targets():
            unit.prefetch_for_backward()
        return None

    def _backward_prefetch_targets(self) -> list:
        if self.unit.backward_prefetch is not None:
            return self.unit.backward_prefetch
        following = self.runtime.next_in_backward(self.unit)
        return [] if following is None else [following]

    def on_backward(self, grads) -> tuple:
        # autograd has just read the gathered memory: it must not have been released since
        self.memory.check_valid_for_backward(self._describe())
        self.runtime.backward_started(self.unit)
        self.in_backward_use = False
        self.uses_awaiting_backward = max(0, self.uses_awaiting_backward - 1)
        grads = [g if g is not None else
                 mint.zeros(p.orig_shape, dtype=p.param_dtype or p.orig_dtype)
                 for p, g in zip(self.params, grads)]
        out = self.reduce_path.backward(grads)
        self._end_of_backward()
        return out

    def _end_of_backward(self) -> None:
        """After one use's backward: the gathered memory goes once no recorded use of this unit
        awaits its backward (another use's ops may still read it); the end of the backward pass
        settles every unit either way (:meth:`settle_backward`)."""
        if self.uses_awaiting_backward == 0:
            self._outside_uses = 0
            self._release_after_backward()
        if self.unit.is_root and not in_backward():
            # called outside autograd (no final callback to queue): the root ends the step
            self.runtime.end_backward_pass()

    def _release_after_backward(self) -> None:
        if self.settings.reshard_after_backward or self._installed_for_backward:
            self.memory.uninstall()     # what unshard() or the backward pre-hook installed
        self._installed_for_backward = False
        if self.settings.reshard_after_backward:
            self.memory.release()

    # -- back to rest -----------------------------------------------------------------------------
    def settle_backward(self) -> None:
        """The backward pass ended (autograd's final callback): uses that got no backward (an
        output the loss ignored) no longer hold the unit's gathered memory."""
        self.in_backward_use = False
        self.uses_awaiting_backward = 0
        self._outside_uses = 0
        if not self.gathered:
            self._release_after_backward()

    def reset_after_failure(self) -> None:
        """Back to rest after a forward that raised: no use awaits a backward, nothing is
        installed or gathered, no prefetch is pending. Gradients already reduced or accumulated
        (micro-steps before the failure) are kept."""
        self._forwarded.clear()
        self._post_ran.clear()
        self.gathered = False
        self.in_backward_use = False
        self.uses_awaiting_backward = 0
        self._outside_uses = 0
        self._installed_for_backward = False
        self.memory.abandon_prefetch()
        self.memory.uninstall()
        self.memory.release()


def cast_floating(value, dtype):
    if isinstance(value, ms.Tensor) and value.dtype in SUPPORTED_DTYPES \
            and value.dtype != dtype:
        return value.astype(dtype)
    return value
