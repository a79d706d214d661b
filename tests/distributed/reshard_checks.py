"""Rank-side checks of ``reshard_after_forward`` (fsdp_cases.py at world size 2, hsdp_cases.py on
the (2, 2) mesh): the same model trained twice from the same start, with the gathered parameters
freed after each unit's forward and gathered again before its backward, and with them kept.

What must hold, per rank:

* **values**: losses, every parameter after training and every ``main_grad`` are bit-identical
  between the two runs (the same collectives on the same bytes). These runs turn
  ``poison_on_release`` off, so released memory is really given back; a backward that read it
  would raise (the unit checks its buffers) or read other values;
* **memory**, measured on the units' own buffers while the step runs: when the loss is computed
  (every forward done, no backward yet) no non-root unit holds gathered memory with resharding
  (every one does without); whenever a unit's backward starts, at most two non-root units hold
  it (the running one and the one prefetched for the next backward); after the step none does.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from gradpool.app.config import from_dict
from gradpool.app.model import next_token_loss
from gradpool.app.train import build_sharded_model, gathered_params, train_sharded
from gradpool.runtime import runtime_for
from harness import equal


def _non_root_units(model) -> list:
    return [u for u in model._hsdp_units() if not u.is_root]     # pylint: disable=protected-access


class MemoryProbe:
    """Records, on each non-root unit's gathered buffers, what is resident at three moments."""

    def __init__(self, model):
        self.units = _non_root_units(model)
        self.at_loss: list[list[int]] = []         # resident bytes per unit when the loss is ready
        self.at_backward: list[int] = []           # units resident when a unit's backward starts
        for unit in self.units:
            unit.steps.on_backward = self._watching(unit, unit.steps.on_backward)

    def _resident_units(self) -> int:
        return sum(1 for u in self.units if u.gathered_bytes > 0)

    def _watching(self, unit, on_backward):
        def watched(grads):
            self.at_backward.append(self._resident_units())
            return on_backward(grads)
        return watched

    def loss_ready(self) -> None:
        self.at_loss.append([u.gathered_bytes for u in self.units])


def train_once(cfg, build: dict, prepare: Optional[Callable] = None,
               builder: Callable = build_sharded_model):
    model = builder(cfg, **build)
    if prepare is not None:
        prepare(model)
    probe = MemoryProbe(model)
    forward = next_token_loss

    def loss_fn(m, tokens):            # what train_sharded calls, with the probe in between
        loss = forward(m, tokens)
        probe.loss_ready()
        return loss

    runtime = runtime_for(cfg.gradpool)
    import gradpool.app.train as train_module
    train_module.next_token_loss = loss_fn
    try:
        records = train_sharded(cfg, model, runtime.comm, runtime.pool)
    finally:
        train_module.next_token_loss = forward
    return model, records, probe


def _main_grads(model) -> dict:
    return {p.name: None if getattr(p, "main_grad", None) is None
            else p.main_grad.asnumpy().copy() for p in model.trainable_params()}


def reshard_checks(base: list, overrides: list, build: Optional[dict] = None,
                   prepare: Optional[Callable] = None,
                   builder: Callable = build_sharded_model) -> dict:
    """Train with ``reshard_after_forward`` true and false (``base + overrides``) and compare;
    ``builder(cfg, **build)`` makes the sharded model, ``prepare(model)`` sets it up."""
    build = build or {}
    runs = {}
    for reshard in (True, False):
        # poison off: released memory is really given back (poison keeps it, NaN-filled)
        cfg = from_dict({}, base + list(overrides)
                        + [f"fully_shard.reshard_after_forward={str(reshard).lower()}",
                           "gradpool.poison_on_release=false"])
        runs[reshard] = train_once(cfg, build, prepare, builder)
    (on, rec_on, probe_on), (off, rec_off, probe_off) = runs[True], runs[False]
    checks = {"losses bit-identical": equal([r.loss for r in rec_on], [r.loss for r in rec_off])}
    params_on, params_off = gathered_params(on), gathered_params(off)
    for name, value in params_off.items():
        checks[f"param {name} bit-identical"] = equal(
            bool(np.array_equal(params_on[name], value)), True)
    grads_on, grads_off = _main_grads(on), _main_grads(off)
    for name, value in grads_off.items():
        same = value is None and grads_on[name] is None or (
            value is not None and grads_on[name] is not None
            and np.array_equal(grads_on[name], value))
        checks[f"main_grad {name} bit-identical"] = equal(bool(same), True)
    sizes = [sum(b.nbytes for b in u.buffers if b is not None) for u in probe_on.units]
    checks["every non-root unit gathers into buffers of its own"] = equal(
        all(s > 0 for s in sizes) and len(sizes) > 0, True)
    checks["reshard on: no non-root unit holds gathered memory when the loss is ready"] = equal(
        sorted({b for snapshot in probe_on.at_loss for b in snapshot}), [0])
    checks["reshard off: every non-root unit holds it then"] = equal(
        [snapshot for snapshot in probe_off.at_loss][-1], sizes)
    checks["reshard on: at most 2 non-root units resident when a backward starts"] = equal(
        bool(probe_on.at_backward) and max(probe_on.at_backward) <= 2, True)
    checks["reshard on: nothing gathered stays after the step"] = equal(
        [u.gathered_bytes for u in probe_on.units], [0] * len(probe_on.units))
    checks["reshard on: each unit's memory was released after forward and regrown"] = equal(
        all(b.stats.releases >= 2 * len(rec_on) for u in probe_on.units
            for b in u.buffers if b is not None), True)
    return checks
