"""fully_shard between torch-style steps (world size 1, in this process): under
``enable_mindspore_backward_compat()`` MindSpore's grad flag stays on after a completed
``loss.backward()``, and ``zero_grad()`` must not take that for a graph an exception abandoned
(it did: it closed the graph, the next forward recorded nothing and ``loss.backward()`` raised).
A graph really abandoned (the loss raised after the model's forward) is still closed, and the
next step records. Values against the unsharded model through ``value_and_grad``; every
pattern under both entry points is in tests/distributed/pattern_cases.py."""
import gc
import logging
import sys
from pathlib import Path

import numpy as np
import pytest

import mindspore as ms

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))

import pattern_cases as cases   # noqa: E402
from hyper_parallel.platform.mindspore.autograd_compat import (  # noqa: E402
    disable_mindspore_backward_compat, enable_mindspore_backward_compat)

ABANDONED = "left MindSpore's grad graph open"


def _reference_grads(steps: int) -> list:
    ref = cases.Net()
    grad_fn = ms.value_and_grad(lambda x: cases.loss_of(ref, x), None, ref.trainable_params())
    return [[g.asnumpy().copy() for g in grad_fn(ms.Tensor(cases._batch(s, 0, 1, 4)[0]))[1]]
            for s in range(steps)]


def _shard_grads(model, mode: str) -> list:
    params = model.trainable_params()
    grads = [p.main_grad if mode != "plain" else p.grad for p in params]
    return [g.asnumpy().copy() for g in grads]


@pytest.fixture
def torch_style():
    yield enable_mindspore_backward_compat
    disable_mindspore_backward_compat()


@pytest.mark.parametrize("mode", ["plain", "main_async"])
def test_zero_grad_after_a_completed_backward_keeps_recording(mode, torch_style, caplog):
    want = _reference_grads(3)                  # value_and_grad: before torch-style is on
    model, _ = cases._build(cases.Run(mode=mode), 1)
    # a step boundary first: the runtime is the process's, and a failure an earlier test of this
    # process injected (or a dropped model's forward without backward, once collected) is
    # evidence meant for that test's next zero_grad, not this one's
    gc.collect()
    model.zero_grad()
    torch_style()
    with caplog.at_level(logging.WARNING):
        for step in range(3):
            model.zero_grad()
            cases.loss_of(model, ms.Tensor(cases._batch(step, 0, 1, 4)[0])).backward()
            for got, ref in zip(_shard_grads(model, mode), want[step]):
                np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
            if mode != "plain":      # the gradient is in main_grad; grad holds no zeros
                assert [p.name for p in model.trainable_params() if p.grad is not None] == []
    assert ABANDONED not in caplog.text


@pytest.mark.parametrize("mode", ["plain", "main_async"])
def test_a_graph_the_loss_abandoned_is_closed_and_the_next_step_records(mode, torch_style,
                                                                        caplog):
    want = _reference_grads(1)
    model, _ = cases._build(cases.Run(mode=mode), 1)
    torch_style()
    x = ms.Tensor(cases._batch(0, 0, 1, 4)[0])
    cases.FAIL["where"] = "loss"
    try:
        with pytest.raises(RuntimeError, match="injected failure in the loss"):
            cases.loss_of(model, x)
    finally:
        cases.FAIL["where"] = None
    with caplog.at_level(logging.WARNING):
        model.zero_grad()
    assert ABANDONED in caplog.text
    cases.loss_of(model, x).backward()
    for got, ref in zip(_shard_grads(model, mode), want[0]):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", ["plain", "main_async"])
def test_after_a_backward_whose_cell_hook_raised_the_next_step_records(mode, torch_style):
    """MindSpore turns its grad flag off when a cell's backward hook raises inside
    ``loss.backward()`` (a unit refusing a collective order does that at 2 ranks): zero_grad
    turns recording back on, and the next step is exact."""
    want = _reference_grads(1)
    model, _ = cases._build(cases.Run(mode=mode), 1)
    torch_style()
    x = ms.Tensor(cases._batch(0, 0, 1, 4)[0])

    def refuse(cell, grad_output):
        raise RuntimeError("injected failure in a backward hook")
    handle = model.b.register_backward_pre_hook(refuse)
    with pytest.raises(RuntimeError, match="injected failure in a backward hook"):
        cases.loss_of(model, x).backward()
    handle.remove()
    model.zero_grad()
    cases.loss_of(model, x).backward()
    for got, ref in zip(_shard_grads(model, mode), want[0]):
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
