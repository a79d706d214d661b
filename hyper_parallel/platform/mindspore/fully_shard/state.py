"""One ``fully_shard`` unit: gathers its parameters before forward, reduces their gradients.

MindSpore 2.10 has no ``Tensor.backward``; training goes through ``ms.value_and_grad``. So the
unit's forward pre-hook passes all its local shards through one custom autograd function: its
forward all-gathers the full parameters (installed as plain attributes that shadow the cells'
``Parameter`` entries), and its backward receives the full gradients from autograd, reduces them
through gradpool, and returns the local shard gradients. ``value_and_grad(fn, None,
module.trainable_params())`` therefore returns the reduced shard gradients directly.

With ``set_requires_gradient_sync(False)`` a backward packs (first micro-step) or accumulates
(later ones) the gradients into the unit's pool buckets and returns zero shard gradients; the
next synchronized backward adds its own gradients and reduces the buckets once.
"""
from __future__ import annotations

import logging
from typing import Optional

import mindspore as ms
from mindspore import mint
from mindspore.common._grad_function import _Function

from gradpool.comm import check_reduce_op
from gradpool.reducer import GradReducer, PackedBucket
from hyper_parallel.platform.mindspore.fully_shard.param import MindSporeHSDPParamV2

logger = logging.getLogger(__name__)


def _make_gather_function(unit: "HSDPUnitState"):
    class UnitGather(_Function):
        @staticmethod
        def forward(ctx, *local_params):
            return tuple(p.unsharded(t) for p, t in zip(unit.params, local_params))

        @staticmethod
        def backward(ctx, *grads):
            return unit.on_backward(grads)

    return UnitGather


class HSDPUnitState:
    """Parameters, hooks and pending reductions of one ``fully_shard`` unit."""

    def __init__(self, module, params: list[MindSporeHSDPParamV2], reducer: GradReducer,
                 mp_policy, reshard_after_forward: bool):
        self.module = module
        self.params = params
        self.reducer = reducer
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.requires_sync = True
        self.reduce_op = "avg"
        self._pending: Optional[tuple[list[PackedBucket], list[PackedBucket]]] = None
        self._gather = _make_gather_function(self)
        if params:
            module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)

    # -- forward ----------------------------------------------------------------------------------
    def _pre_forward(self, cell, inputs):
        fulls = self._gather.apply(*[p.sharded_param for p in self.params])
        if not isinstance(fulls, (tuple, list)):
            fulls = (fulls,)
        self._install(fulls)
        dtype = self.mp_policy.param_dtype
        if dtype is not None and self.mp_policy.cast_forward_inputs:
            return tuple(_cast_floating(x, dtype) for x in inputs)
        return None

    def _post_forward(self, cell, inputs, outputs):
        if self.reshard_after_forward:
            self.uninstall()
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return None
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(_cast_floating(x, dtype) for x in outputs)
        return _cast_floating(outputs, dtype)

    def _install(self, fulls) -> None:
        for param, full in zip(self.params, fulls):
            # An instance attribute is found before Cell.__getattr__ looks in _params, so the
            # cell's construct reads the gathered tensor while trainable_params() stays sharded.
            for cell, attr in param.owners:
                cell.__dict__[attr] = full

    def uninstall(self) -> None:
        for param in self.params:
            for cell, attr in param.owners:
                cell.__dict__.pop(attr, None)

    def unshard(self) -> None:
        self._install([p.unsharded(p.sharded_param) for p in self.params])

    # -- backward ---------------------------------------------------------------------------------
    def on_backward(self, grads) -> tuple:
        grads = [g if g is not None else mint.zeros(p.orig_shape, dtype=p.param_dtype or p.orig_dtype)
                 for p, g in zip(self.params, grads)]
        for param, grad in zip(self.params, grads):
            param.set_unsharded_grad(grad)
        if not self.requires_sync:
            self._accumulate(grads)
            return tuple(mint.zeros(p.local_shape, dtype=p.orig_dtype) for p in self.params)
        if self._pending is not None:
            self._launch_pending(grads)
        elif self.reducer.config.comm_fusion:
            self._launch_fused(grads)
        else:
            for param in self.params:
                param.reduce_scatter_grad(async_op=True, reduce_op=self.reduce_op)
        return tuple(p.apply_reduced_grad(p.reduce_scatter_output()) for p in self.params)

    def _split(self):
        sharded = [(i, p) for i, p in enumerate(self.params) if not p.replicate]
        replicated = [(i, p) for i, p in enumerate(self.params) if p.replicate]
        return sharded, replicated

    def _pack(self, grads, for_accumulation: bool) -> tuple[list, list]:
        """Pack the sharded and the replicated gradients; on failure give back what was packed."""
        sharded, replicated = self._split()
        packed: tuple[list, list] = ([], [])
        try:
            if sharded:
                packed[0].extend(self.reducer.pack(
                    [grads[i] for i, _ in sharded], [p.shard_dim for _, p in sharded],
                    allow_borrow=not for_accumulation))
            if replicated:
                packed[1].extend(self.reducer.pack([grads[i] for i, _ in replicated],
                                                   world_size=1, allow_borrow=False))
        except BaseException:
            self._discard(packed)
            raise
        return packed

    def _discard(self, packed) -> None:
        for buckets in packed:
            self.reducer.discard(buckets)

    def _accumulate(self, grads) -> None:
        if self._pending is None:
            self._pending = self._pack(grads, for_accumulation=True)
        else:
            sharded, replicated = self._split()
            try:
                self.reducer.accumulate(self._pending[0], [grads[i] for i, _ in sharded])
                self.reducer.accumulate(self._pending[1], [grads[i] for i, _ in replicated])
            except BaseException:
                self._discard(self._pending)
                self._pending = None
                raise
        for param in self.params:
            param.finish_local_use()

    def _launch_pending(self, grads) -> None:
        self._accumulate(grads)
        pending, self._pending = self._pending, None
        self._attach(*pending)

    def _launch_fused(self, grads) -> None:
        self._attach(*self._pack(grads, for_accumulation=False))

    def _attach(self, sharded_buckets, replicated_buckets) -> None:
        """Launch both groups; each parameter adopts its entry of its group's result. A launch
        that fails has given its own buckets back; the other group's are given back here."""
        sharded, replicated = self._split()
        if sharded:
            try:
                result = self.reducer.launch(sharded_buckets, op=self.reduce_op,
                                             count=len(sharded))
            except BaseException:
                self.reducer.discard(replicated_buckets)
                raise
            for index, (_, param) in enumerate(sharded):
                param.attach_result(result, index)
        if replicated:
            result = self.reducer.launch(replicated_buckets, op=self.reduce_op,
                                         count=len(replicated), all_reduce=True)
            for index, (_, param) in enumerate(replicated):
                param.attach_result(result, index)

    # -- controls ---------------------------------------------------------------------------------
    def set_reduce_op(self, op: str) -> None:
        check_reduce_op(op)
        self.reduce_op = op

    def zero_grad(self) -> None:
        if self._pending is not None:
            for buckets in self._pending:
                self.reducer.discard(buckets)
            self._pending = None
        for param in self.params:
            param.zero_grad()


def _cast_floating(value, dtype):
    if isinstance(value, ms.Tensor) and value.dtype in (ms.float32, ms.float16, ms.bfloat16) \
            and value.dtype != dtype:
        return value.astype(dtype)
    return value
