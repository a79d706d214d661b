"""hyper_parallel.platform.mindspore.autograd_compat: torch-style ``backward`` and its companions on
MindSpore 2.10 tensors, values against NumPy, and the typed refusals."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Parameter, Tensor, mint
from mindspore._c_expression import TensorPy

from gradpool import ArgumentTypeError, BackwardNotRecordedError, InvalidArgumentError
from hyper_parallel.platform.mindspore import autograd_compat
from hyper_parallel.platform.mindspore.autograd_compat import (disable_mindspore_backward_compat,
                                                               enable_mindspore_backward_compat)

NAMES = ("backward", "grad", "requires_grad", "is_leaf", "grad_fn", "retain_grad", "detach")
X = np.array([[1.0, -2.0, 0.5], [0.25, 3.0, -1.0]], np.float32)
W = np.array([[0.5, -1.0], [2.0, 0.25], [-0.75, 1.5]], np.float32)


@pytest.fixture(autouse=True)
def torch_style():
    enable_mindspore_backward_compat()
    yield
    disable_mindspore_backward_compat()   # the rest of the process trains through value_and_grad


def _square_loss(w, x=None):
    y = mint.matmul(Tensor(X) if x is None else x, w)
    return (y * y).sum()


def _square_loss_grad() -> np.ndarray:
    return 2.0 * X.T @ (X @ W)     # d/dW sum((XW)^2)


def test_every_name_is_there_and_parameter_keeps_its_own_requires_grad():
    own = Parameter.__dict__["requires_grad"]
    enable_mindspore_backward_compat()     # idempotent: the same members, nothing re-wrapped
    members = {name: TensorPy.__dict__[name] for name in NAMES if name in TensorPy.__dict__}
    enable_mindspore_backward_compat()
    assert {name: TensorPy.__dict__[name] for name in members} == members
    for name in NAMES:
        assert hasattr(Tensor(X), name) and hasattr(Parameter(Tensor(W), name="w"), name), name
    assert Parameter.__dict__["requires_grad"] is own
    frozen = Parameter(Tensor(W), name="frozen", requires_grad=False)
    assert frozen.requires_grad is False and frozen._requires_grad is False


def test_backward_fills_leaf_grads_and_accumulates():
    w = Parameter(Tensor(W), name="w")
    loss = _square_loss(w)
    assert loss.grad_fn is not None and not loss.is_leaf
    assert w.is_leaf and w.grad_fn is None and w.grad is None
    loss.backward()
    np.testing.assert_allclose(w.grad.asnumpy(), _square_loss_grad(), rtol=1e-6)
    held = w.grad
    _square_loss(w).backward(Tensor([0.5], ms.float32))  # mindformers' [1]-shaped sense
    np.testing.assert_allclose(w.grad.asnumpy(), 1.5 * _square_loss_grad(), rtol=1e-6)
    np.testing.assert_allclose(held.asnumpy(), _square_loss_grad(), rtol=1e-6)  # out of place
    w.grad = None
    assert w.grad is None


def test_inputs_limits_which_leaves_get_a_grad():
    w = Parameter(Tensor(W), name="w")
    x = Tensor(X)
    x.requires_grad = True
    assert x.requires_grad is True
    _square_loss(w, x).backward(inputs=[x])
    np.testing.assert_allclose(x.grad.asnumpy(), 2.0 * (X @ W) @ W.T, rtol=1e-6)
    assert w.grad is None


def test_retain_graph_and_create_graph():
    w = Parameter(Tensor(W), name="w")
    loss = _square_loss(w)
    loss.backward(retain_graph=True)
    loss.backward()
    np.testing.assert_allclose(w.grad.asnumpy(), 2.0 * _square_loss_grad(), rtol=1e-6)
    with pytest.raises(RuntimeError, match="backward the graph twice"):
        loss.backward()
    x = Tensor(np.array([2.0, -1.0], np.float32))
    x.requires_grad = True
    (x * x * x).sum().backward(create_graph=True)
    first = x.grad
    np.testing.assert_allclose(first.asnumpy(), [12.0, 3.0])      # 3x^2
    x.grad = None
    first.sum().backward()
    np.testing.assert_allclose(x.grad.asnumpy(), [12.0, -6.0])    # 6x


def test_detach_leaves_the_graph():
    w = Parameter(Tensor(W), name="w")
    y = mint.matmul(Tensor(X), w)
    d = y.detach()
    assert d.grad_fn is None and d.requires_grad is False
    np.testing.assert_array_equal(d.asnumpy(), X @ W)


def test_refusals_are_typed_and_name_the_value():
    w = Parameter(Tensor(W), name="w")
    y = mint.matmul(Tensor(X), w)
    with pytest.raises(InvalidArgumentError, match=r"shape \(2, 2\) needs a gradient"):
        y.backward()
    with pytest.raises(InvalidArgumentError, match=r"gradient has shape \(3,\)"):
        y.backward(Tensor(np.ones(3, np.float32)))
    with pytest.raises(ArgumentTypeError, match="Tensor or None, got list"):
        y.backward([1.0])
    with pytest.raises(InvalidArgumentError, match="inputs is empty"):
        y.sum().backward(inputs=[])
    with pytest.raises(ArgumentTypeError, match="requires_grad must be a bool"):
        Tensor(X).requires_grad = 1
    with pytest.raises(InvalidArgumentError, match=r"shape \(2,\) assigned to a tensor of shape"):
        w.grad = Tensor(np.ones(2, np.float32))
    with pytest.raises(BackwardNotRecordedError, match="depends on no tensor requiring grad"):
        (Tensor(X) * 2.0).sum().backward()


def test_value_and_grad_turns_recording_off_and_backward_says_so():
    w = Parameter(Tensor(W), name="w")
    ms.value_and_grad(_square_loss, None, [w])(w)
    with pytest.raises(BackwardNotRecordedError, match="grad flag is off.*call it again"):
        _square_loss(w).backward()
    enable_mindspore_backward_compat()
    _square_loss(w).backward()
    np.testing.assert_allclose(w.grad.asnumpy(), _square_loss_grad(), rtol=1e-6)
    assert autograd_compat.backward_compat_recording()
