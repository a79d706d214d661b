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

from gradpool import GradReducer, PackedBucket, check_reduce_op
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
        for param in params:
            param.unit = self
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
            self._accumulate(self.params)
            return tuple(mint.zeros(p.local_shape, dtype=p.orig_dtype) for p in self.params)
        self.reduce(self.params, self.reduce_op)
        return tuple(p.apply_reduced_grad(p.reduce_scatter_output()) for p in self.params)

    def reduce(self, params: list[MindSporeHSDPParamV2], op: str) -> None:
        """The unit's one reduce path: hand the gradients of ``params`` (and, for the whole unit,
        the micro-steps accumulated so far) to the reducer once per group (sharded, replicated),
        and let each parameter adopt its entry of the result. Fused or not is the reducer's
        grouping."""
        check_reduce_op(op)
        for param in params:
            param.clear_reduce_scatter_output()
        sharded, replicated = self._split(params)
        if self._pending is not None and params == self.params:
            self._accumulate(params)
            (sharded_buckets, replicated_buckets), self._pending = self._pending, None
            try:
                if sharded:
                    _adopt(sharded, self.reducer.launch(sharded_buckets, op=op,
                                                        count=len(sharded)))
            except BaseException:
                self.reducer.discard(replicated_buckets)   # the failed launch gave back its own
                raise
            if replicated:
                _adopt(replicated, self.reducer.launch(replicated_buckets, op=op,
                                                       count=len(replicated), all_reduce=True))
            return
        if sharded:
            _adopt(sharded, self.reducer.reduce_scatter(
                [p.unsharded_grad for p in sharded], [p.shard_dim for p in sharded], op=op))
        if replicated:
            _adopt(replicated, self.reducer.all_reduce([p.unsharded_grad for p in replicated],
                                                       op=op))

    @staticmethod
    def _split(params):
        return [p for p in params if not p.replicate], [p for p in params if p.replicate]

    def _pack_for_accumulation(self, params) -> tuple[list, list]:
        """Pack the sharded and the replicated gradients into buckets of their own (never
        borrowed: later micro-steps add into them); on failure give back what was packed."""
        sharded, replicated = self._split(params)
        packed: tuple[list, list] = ([], [])
        try:
            if sharded:
                packed[0].extend(self.reducer.pack(
                    [p.unsharded_grad for p in sharded], [p.shard_dim for p in sharded],
                    allow_borrow=False))
            if replicated:
                packed[1].extend(self.reducer.pack([p.unsharded_grad for p in replicated],
                                                   world_size=1, allow_borrow=False))
        except BaseException:
            self._discard(packed)
            raise
        return packed

    def _discard(self, packed) -> None:
        for buckets in packed:
            self.reducer.discard(buckets)

    def _accumulate(self, params) -> None:
        """A micro-step: pack (first) or add (later) the gradients into the unit's buckets."""
        if self._pending is None:
            self._pending = self._pack_for_accumulation(params)
        else:
            sharded, replicated = self._split(params)
            try:
                self.reducer.accumulate(self._pending[0], [p.unsharded_grad for p in sharded])
                self.reducer.accumulate(self._pending[1], [p.unsharded_grad for p in replicated])
            except BaseException:
                self._discard(self._pending)
                self._pending = None
                raise
        for param in params:
            param.finish_local_use()

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


def _adopt(params, result) -> None:
    for index, param in enumerate(params):
        param.attach_result(result, index)


def _cast_floating(value, dtype):
    if isinstance(value, ms.Tensor) and value.dtype in (ms.float32, ms.float16, ms.bfloat16) \
            and value.dtype != dtype:
        return value.astype(dtype)
    return value
