"""What a ``fully_shard`` unit asks MindSpore's PyNative autograd (2.10), in one place.

* ``in_backward()``: autograd's engine is running. A cell's forward hook that fires then is a
  **recompute forward**: MindSpore's non-reentrant recompute (``Cell.recompute(use_reentrant=
  False)``, ``mindspore.recompute(fn, ..., use_reentrant=False)``, this package's
  ``checkpoint``) re-runs the forward when backward unpacks the tensors it did not save.
* ``grad_recorded()``: the forward being run is recorded for a backward (inside
  ``value_and_grad``, not under ``no_grad``): only such a use of a unit will get a backward.
* ``queue_end_of_backward(fn)``: ``fn`` runs once the running backward pass has computed every
  gradient (PyTorch FSDP2 ends its step the same way, with autograd's final callback), whatever
  the model's root holds and whichever units the loss used.
* ``grad_graph_open()`` / ``discard_open_grad_graph()``: an exception raised inside
  ``value_and_grad`` (in any net, sharded or not) leaves MindSpore's grad graph open: its
  ``end_graph`` never runs and ``grad_flag()`` stays True after the call. Every later
  ``value_and_grad`` then records inside the stale graph, which on 2 CPU ranks under blocking
  launch changed a ``fully_shard`` model's loss and gradients (``docs/using-fully-shard.md``,
  "A forward that raised"); MindSpore's own recovery after a failed compile is ``clear_res()``.
  Under torch-style backward (``autograd_compat.enable_mindspore_backward_compat``) the flag is
  on between steps by design (``torch_style_recording()``): an open flag then proves nothing,
  and a discard turns recording back on.
* ``register_backward_pre_hook(cell, hook)``: MindSpore's, without its cell <-> primitive
  reference cycle (a dropped model is freed by reference counting).
"""
from __future__ import annotations

import weakref

from mindspore.graph.api import _pynative_executor

from hyper_parallel.platform.mindspore.autograd_compat import (backward_compat_recording,
                                                               restore_recording)

NOT_IN_BACKWARD = -1


def backward_engine() -> int:
    """The id of the autograd engine running now, ``NOT_IN_BACKWARD`` outside a backward."""
    return _pynative_executor.get_current_autodiff_engine_id()


def in_backward() -> bool:
    return backward_engine() != NOT_IN_BACKWARD


def grad_recorded() -> bool:
    return bool(_pynative_executor.requires_grad())


def queue_end_of_backward(fn) -> None:
    """Run ``fn`` when the backward pass running now ends (call only inside a backward)."""
    _pynative_executor.queue_backward_final_callback(fn)


def replaying_forward() -> bool:
    """A non-reentrant recompute re-runs a forward now: inside backward, under the saved-tensor
    hook that collects the recomputed activations. (A reentrant recompute's inner forward runs
    inside backward without it: a forward of its own, with its own nested backward.)"""
    return in_backward() and bool(_pynative_executor.is_saved_tensor_hook_active())


def grad_graph_open() -> bool:
    """A grad graph is being recorded (between ``value_and_grad``'s start and its end)."""
    return bool(_pynative_executor.grad_flag())


def torch_style_recording() -> bool:
    """Every forward is recorded for a torch-style ``loss.backward()``: the grad flag stays on
    between steps, whatever happened."""
    return backward_compat_recording()


def resume_recording() -> None:
    """Under torch-style backward, turn MindSpore's grad flag back on (a ``value_and_grad`` call
    turns it off when it returns, and so does a backward whose cell hook raised)."""
    restore_recording()


def discard_open_grad_graph() -> None:
    """Drop PyNative's grad graphs and their state (what MindSpore does after a failed compile);
    under torch-style backward, forwards are recorded again afterwards (``clear_res`` turns the
    grad flag off)."""
    _pynative_executor.clear_res()
    restore_recording()


class _CellWeakly:
    """A cell's backward-hook primitive refers to its cell through a weak reference."""

    @property
    def cell(self):
        ref = self.__dict__.get("_weak_cell")
        return None if ref is None else ref()

    @cell.setter
    def cell(self, cell) -> None:
        self.__dict__["_weak_cell"] = None if cell is None else weakref.ref(cell)


_WEAK_HOOK_CLASSES: dict = {}


def register_backward_pre_hook(cell, hook):
    """``cell.register_backward_pre_hook(hook)``, without the reference cycle MindSpore makes:
    the cell keeps its ``CellBackwardHook`` primitive, which keeps the cell (to pass it to the
    hooks), so a cell with a backward pre-hook is freed only by the garbage collector. Here the
    primitive holds the cell weakly (it calls hooks only while the cell runs), so a dropped
    model is freed by reference counting, the collector on or off."""
    handle = cell.register_backward_pre_hook(hook)
    primitive = cell.__dict__.get("_cell_backward_pre_hook")
    if primitive is not None and not isinstance(primitive, _CellWeakly):
        kind = type(primitive)
        weak_kind = _WEAK_HOOK_CLASSES.get(kind)
        if weak_kind is None:
            weak_kind = _WEAK_HOOK_CLASSES[kind] = type(kind.__name__, (_CellWeakly, kind), {})
        strong = primitive.__dict__.pop("cell", None)
        primitive.__class__ = weak_kind
        primitive.cell = strong
    return handle
