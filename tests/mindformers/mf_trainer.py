"""mindformers' ``Trainer`` step on gradpool: its own ``training_step`` (gradient accumulation
over micro-batches, ``loss.backward(sense)``, ``set_requires_all_reduce`` on the last micro-step),
``_optimizer_update`` (``_calculate_global_grad_norm`` over ``get_grad`` = ``main_grad``,
clipping, its ``AdamW``, ``zero_grad``), ``_compute_data_parallel_size``, ``_apply_parallelism``
and ``_create_optimizer_and_scheduler``, called on a ``Trainer`` whose construction is reduced to
the attributes these methods read.

``Trainer.__init__`` itself is not run: it also builds a dataset, checkpoint and callback
machinery this test does not need. :class:`TrainerUnderTest` sets what ``__init__`` would set
for these methods (config, world size, the model list, optimizer and scheduler through the
Trainer's own builder, its ``MonitorGroup``) and takes its micro-batches from a list instead of
the dataset iterator (``_next_batch``). Every step method is mindformers', unchanged.
"""
from __future__ import annotations

import numpy as np

import mf_flow

import mindspore as ms                                                   # noqa: E402
from mindformers.pynative.tools.monitor import MonitorGroup              # noqa: E402
from mindformers.pynative.trainer.trainer import Trainer                 # noqa: E402


class TrainerUnderTest(Trainer):
    """mindformers' Trainer with its step methods, fed from ``batches`` (``[step][micro] ->
    (input_ids, labels)`` of this rank)."""

    # pylint: disable=super-init-not-called
    def __init__(self, config, model, world: int, batches, parallel: bool,
                 initial_state=None):
        from hyper_parallel.platform.mindspore.autograd_compat import (
            enable_mindspore_backward_compat)
        enable_mindspore_backward_compat()          # as Trainer.__init__ does, for loss.backward
        self.config = config
        self.is_inference = False
        self.world_size = world
        self.enable_parallel = parallel
        self.global_batch_size = config.training.global_batch_size
        self.dynamic_batch_enabled = False
        self._dsa_warmup_layerwise_backward = False
        self.use_skip_step_on_nan = False
        self.compute_loss_func = None
        self._compute_data_parallel_size()           # -> num_accumulation_steps
        self.model = model
        if parallel:
            self._apply_parallelism(self.model, self.config.parallelism)
        self.model = self.model if isinstance(self.model, list) else [self.model]
        for part in self.model:
            mf_flow.materialize(part)
        if initial_state is not None:       # the reference: the sharded model's initial weights
            mf_flow.load_full_state(self.model[0], initial_state)
        self._register_grad_hooks()
        self.optimizer, self.lr_scheduler = self._create_optimizer_and_scheduler(
            None, None, config.optimizer, config.lr_scheduler)
        self.monitor = MonitorGroup(self.config, model=self.model)
        self._batches = iter([micro for step in batches for micro in step])

    def _next_batch(self):
        ids, labels = next(self._batches)
        return {"input_ids": ms.Tensor(ids), "labels": ms.Tensor(labels)}


def trainer_config(model_cfg: dict, world: int, local_batch: int, accumulation: int,
                   max_norm: float, lr: float, data_parallel_shard: int = -1):
    """A config whose global batch is ``accumulation`` micro-batches of ``local_batch``
    sequences per data-parallel rank: ``Trainer._compute_data_parallel_size`` derives the
    accumulation from it."""
    cfg = mf_flow.train_config(model_cfg, data_parallel_shard=data_parallel_shard,
                               max_norm=max_norm)
    cfg.training.local_batch_size = local_batch
    cfg.training.global_batch_size = local_batch * world * accumulation
    cfg.training.steps = 10
    cfg.lr_scheduler.learning_rate = lr
    cfg.optimizer.weight_decay = 0.0
    # Adam divides by sqrt(v) + eps: with a tiny eps a near-zero gradient element moves its
    # parameter by ~lr whatever its sign's noise, so float32 summation-order differences
    # (1e-7 of the gradient) would decide updates of size lr. eps = 1e-3 keeps the update a
    # smooth function of the gradient, and the comparison meaningful at 1e-5.
    cfg.optimizer.eps = 1e-3
    return cfg


def run_steps(trainer: TrainerUnderTest, steps: int) -> tuple[list, list]:
    """``training_step`` ``steps`` times: the (all-reduced) losses and global grad norms."""
    losses, norms = [], []
    for step in range(steps):
        loss, norm = trainer.training_step(step)
        losses.append(float(np.asarray(loss.asnumpy() if hasattr(loss, "asnumpy") else loss)))
        norms.append(float(np.asarray(norm.asnumpy() if hasattr(norm, "asnumpy") else norm)))
    return losses, norms


def reference_batches(batches, world: int):
    """Every step's data as one micro-batch: all micro-steps' and ranks' sequences concatenated
    (each sequence has the same number of tokens, so the mean over the concatenation is the
    mean over micro-steps and ranks of each one's mean)."""
    return [[(np.concatenate([micro[r][0] for micro in step for r in range(world)]),
              np.concatenate([micro[r][1] for micro in step for r in range(world)]))]
            for step in batches]
