"""PyTorch-style ``loss.backward()`` on MindSpore 2.10 tensors.

MindSpore 2.10 trains through ``value_and_grad``; its tensors have no ``backward``, ``grad``,
``is_leaf``, ``grad_fn``, ``retain_grad`` or ``detach`` (a ``Parameter`` has ``requires_grad``,
a plain ``Tensor`` does not). Its C++ autograd has all the pieces: every op run while the grad
flag is on records a ``BackwardNode`` on its output (``Tensor._grad_node``), and
``mindspore._c_expression.run_backward`` runs those nodes and, with ``accumulate_grad=True``,
adds each leaf's gradient into ``Tensor._grad`` (out of place: a tensor held from ``grad``
keeps its value). :func:`enable_mindspore_backward_compat` turns the grad flag on (from then
on every forward outside ``no_grad`` is recorded, as in PyTorch) and gives the tensor classes
the missing names over those pieces; a name a class already has natively is left alone.

What MindSpore 2.10 does that a torch user would not expect (measured on CPU):

* a ``value_and_grad`` call ends by turning the grad flag off, so after one, forwards record
  nothing until :func:`enable_mindspore_backward_compat` is called again; ``backward`` on such
  an unrecorded output raises :class:`gradpool.BackwardNotRecordedError` saying so;
* ``retain_grad()`` is accepted, but the backward that fills it needs the ``Clone`` kernel,
  which the CPU backend lacks;
* ``create_graph=True`` works (second derivatives are right), but not through a
  ``fully_shard`` unit, whose collectives are not differentiable.
"""
from __future__ import annotations

import logging
import warnings

from mindspore import Tensor, ops
from mindspore._c_expression import TensorPy, pyboost_detach, run_backward
from mindspore.graph.api import _pynative_executor

from gradpool import ArgumentTypeError, BackwardNotRecordedError, InvalidArgumentError

logger = logging.getLogger(__name__)

_STATE = {"patched": False, "recording": False}


def enable_mindspore_backward_compat() -> None:
    """Give tensors torch-style ``backward`` and its companions, and record every forward.

    Idempotent: the tensor classes are extended once; each call turns MindSpore's grad flag on
    (again, after a ``value_and_grad`` call turned it off)."""
    if not _STATE["patched"]:
        installed = [name for name, member in _MEMBERS.items() if _install(name, member)]
        _STATE["patched"] = True
        logger.debug("torch-style autograd names added to MindSpore tensors: %s", installed)
    _STATE["recording"] = True
    _pynative_executor.set_grad_flag(True)


def disable_mindspore_backward_compat() -> None:
    """Stop recording every forward (MindSpore's grad flag off, as before the enable); the added
    tensor names stay (they do nothing until called)."""
    _STATE["recording"] = False
    _pynative_executor.set_grad_flag(False)


def backward_compat_recording() -> bool:
    """:func:`enable_mindspore_backward_compat` is in force: forwards are recorded for
    ``backward`` between steps, so an open grad flag is the normal state, not a graph some
    exception abandoned."""
    return _STATE["recording"]


def restore_recording() -> None:
    """After MindSpore's grad state was reset (``clear_res``), record forwards again if the
    process asked for torch-style backward."""
    if _STATE["recording"]:
        _pynative_executor.set_grad_flag(True)


def _install(name: str, member) -> bool:
    """Put ``member`` on ``TensorPy``, the base of ``Tensor`` and ``Parameter``, unless ``Tensor``
    already has the name natively. A name ``Parameter`` defines itself (``requires_grad``, kept
    in step with ``_requires_grad``) stays its own: a subclass's attribute comes first."""
    if hasattr(Tensor, name):
        return False
    setattr(TensorPy, name, member)
    return True


# -- the members -----------------------------------------------------------------------------------
def _get_requires_grad(self) -> bool:
    return self._requires_grad


def _set_requires_grad(self, value) -> None:
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"requires_grad must be a bool, got {type(value).__name__} "
                                f"{value!r}")
    self._requires_grad = value


def _get_grad(self):
    if not self._is_leaf and not self._retains_grad and self._requires_grad:
        warnings.warn("the .grad of a tensor that is not a leaf is read: backward() fills only "
                      "leaves' (call .retain_grad() on it before backward)", stacklevel=2)
    return self._grad


def _set_grad(self, value) -> None:
    if value is not None:
        if not isinstance(value, TensorPy):
            raise ArgumentTypeError(f"a tensor's grad must be a Tensor or None, got "
                                    f"{type(value).__name__}")
        if tuple(value.shape) != tuple(self.shape):
            raise InvalidArgumentError(f"a grad of shape {tuple(value.shape)} assigned to a "
                                       f"tensor of shape {tuple(self.shape)}")
    self._grad = value


def _leaf(self) -> bool:
    return self._is_leaf


def _retaining(self) -> bool:
    return self._retains_grad


def _grad_fn(self):
    """The node that made this tensor in the recorded graph; None for a leaf or an unrecorded
    tensor (MindSpore gives a leaf a node of its own, which torch does not show)."""
    node = self._grad_node
    if node is None or node.is_leaf():
        return None
    return node


def _retain(self) -> None:
    self._retain_grad()


def _detach(self):
    """A tensor sharing this one's memory, outside the recorded graph."""
    return pyboost_detach(self)


def _backward(self, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> None:
    """Compute the gradients of this tensor and add them into the leaves' ``grad`` (of
    ``inputs`` only, when given). ``gradient`` defaults to one for a one-element float output;
    one with this tensor's element count but another shape (mindformers' ``[1]``-shaped loss
    sense for a scalar loss) is reshaped. The graph is freed unless ``retain_graph``."""
    if not isinstance(create_graph, bool):
        raise ArgumentTypeError(f"create_graph must be a bool, got {create_graph!r}")
    if retain_graph is None:
        retain_graph = create_graph
    elif not isinstance(retain_graph, bool):
        raise ArgumentTypeError(f"retain_graph must be a bool or None, got {retain_graph!r}")
    gradient = _output_gradient(self, gradient)
    if self._grad_node is None:
        raise BackwardNotRecordedError(_not_recorded_reason(self))
    run_backward((self,), (gradient,), retain_graph, create_graph, _inputs(inputs),
                 True, accumulate_grad=True)


def _output_gradient(output, gradient):
    if gradient is None:
        if output.numel() != 1:
            raise InvalidArgumentError(
                f"backward() of a tensor of shape {tuple(output.shape)} needs a gradient: one is "
                "made implicitly only for a one-element output")
        if not (output.is_floating_point() or output.is_complex()):
            raise InvalidArgumentError(f"backward() of a {output.dtype} output: gradients exist "
                                       "only for floating outputs")
        return ops.ones_like(output)
    if not isinstance(gradient, TensorPy):
        raise ArgumentTypeError(f"backward()'s gradient must be a Tensor or None, got "
                                f"{type(gradient).__name__}")
    if tuple(gradient.shape) != tuple(output.shape):
        if gradient.numel() != output.numel():
            raise InvalidArgumentError(f"backward()'s gradient has shape {tuple(gradient.shape)}, "
                                       f"the output {tuple(output.shape)}")
        gradient = gradient.reshape(output.shape)
    if gradient.dtype != output.dtype:
        gradient = gradient.astype(output.dtype)
    return gradient


def _inputs(inputs) -> tuple:
    if inputs is None:
        return ()
    if isinstance(inputs, TensorPy):
        return (inputs,)
    inputs = tuple(inputs)
    if not inputs:
        raise InvalidArgumentError("backward()'s inputs is empty: pass None to fill every leaf")
    bad = [type(x).__name__ for x in inputs if not isinstance(x, TensorPy)]
    if bad:
        raise ArgumentTypeError(f"backward()'s inputs must be tensors, got {bad}")
    return inputs


def _not_recorded_reason(output) -> str:
    shape = tuple(output.shape)
    if not _pynative_executor.grad_flag():
        return (f"backward() of a tensor of shape {shape} that no recorded forward made: "
                "MindSpore's grad flag is off (enable_mindspore_backward_compat() turns it on; a "
                "value_and_grad call turns it off when it ends, so call it again after one)")
    if not _pynative_executor.enable_grad():
        return f"backward() of a tensor of shape {shape} computed under no_grad"
    return (f"backward() of a tensor of shape {shape} that depends on no tensor requiring grad "
            "(no Parameter, no tensor with requires_grad=True)")


_MEMBERS = {
    "backward": _backward,
    "grad": property(_get_grad, _set_grad),
    "requires_grad": property(_get_requires_grad, _set_requires_grad),
    "is_leaf": property(_leaf),
    "retains_grad": property(_retaining),
    "grad_fn": property(_grad_fn),
    "retain_grad": _retain,
    "detach": _detach,
}
