"""``DTensor``: a tensor together with where its pieces are (a :class:`DTensorSpec`).

Two kinds of object are DTensors here:

* **Managed tensors.** A parameter ``fully_shard`` manages *is* its local shard (a MindSpore
  ``Parameter`` of the padded chunk's shape), and its ``main_grad`` is the shard's gradient. Both
  become DTensors in place (:func:`as_managed_dtensor`): their class gains :class:`DTensor`'s
  methods, so ``isinstance(p, DTensor)`` holds, ``p.placements`` / ``p.device_mesh`` say how it is
  laid out, ``p.to_local()`` is ``p`` itself (the tensor *is* the shard: the optimizer updates it
  in place) and ``p.full_tensor()`` all-gathers the whole tensor. ``shape`` stays the local shape
  MindSpore knows; the global one is ``p.global_shape``.
* **Wrappers** from :meth:`DTensor.from_local` and :meth:`DTensor.redistribute`: a local tensor
  held with a spec; ``shape`` is the global shape.

There is no op dispatch on DTensors: every op computes on the local tensor, which is what
mindformers' ``SkipDTensorDispatch`` asks for, so that context manager has nothing to switch off.
The tensors a unit's forward computes with are the gathered full tensors ``fully_shard``
installs: plain tensors, not DTensors (a parameter kept whole installs itself, whose
``to_local()`` is itself). What upstream's DTensor does beyond this (op dispatch for tensor
parallelism, ``distribute_tensor``, layouts) raises :class:`gradpool.FeatureNotProvidedError`.
"""
from __future__ import annotations

import logging
from typing import Optional, Sequence

from gradpool import InvalidArgumentError
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Partial, Placement, Replicate, Shard
from hyper_parallel.core.dtensor.spec import DTensorSpec, spec_from_local
from hyper_parallel.core.not_provided import (DISTRIBUTE_TENSOR, DTENSOR_LAYOUTS, refuse,
                                              refused_function)

__all__ = ["DTensor", "SkipDTensorDispatch", "distribute_tensor", "as_managed_dtensor",
           "held_main_grad", "set_main_grad_default"]
logger = logging.getLogger(__name__)


class DTensor:
    """A local tensor and its :class:`DTensorSpec` (see the module docstring for the two kinds)."""

    _dtensor_spec: DTensorSpec

    def __init__(self, local_tensor, device_mesh: DeviceMesh,
                 placements: Sequence[Placement], *, shape: Optional[Sequence[int]] = None):
        placements = tuple(placements)
        spec = spec_from_local(device_mesh, placements, tuple(local_tensor.shape))
        if shape is not None:
            spec = DTensorSpec(device_mesh, placements, tuple(int(n) for n in shape))
        self.__dict__["_dtensor_local"] = local_tensor
        self.__dict__["_dtensor_spec"] = spec

    @staticmethod
    def from_local(local_tensor, device_mesh: DeviceMesh, placements: Sequence[Placement],
                   *, run_check: bool = False, shape: Optional[Sequence[int]] = None,
                   stride=None) -> "DTensor":
        """``local_tensor`` as this rank's part of a DTensor; without ``shape`` every rank's
        part is assumed to have this shape (the global shape multiplies sharded dims)."""
        del run_check, stride     # nothing is checked across ranks; strides are MindSpore's
        return DTensor(local_tensor, device_mesh, placements, shape=shape)

    # -- layout --------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._dtensor_spec.mesh

    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._dtensor_spec.placements

    @property
    def layout(self) -> DTensorSpec:
        """The layout as a :class:`DTensorSpec` (mesh, placements, global shape): what
        mindformers' ``_apply_spmd_parallelism`` logs for every DTensor parameter. Upstream's
        tensor-parallel ``Layout`` queries (split ids, tensor maps) are refused by name by the
        spec."""
        return self._dtensor_spec

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self._dtensor_spec.global_shape

    @property
    def shape(self) -> tuple[int, ...]:
        # Managed tensors list DTensor after their MindSpore class, so theirs wins there.
        return self._dtensor_spec.global_shape

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(self.to_local().shape)

    def to_local(self):
        """This rank's part: the wrapped tensor, or a managed tensor itself."""
        return self.__dict__.get("_dtensor_local", self)

    # -- collectives ---------------------------------------------------------------------------
    def full_tensor(self):
        """The whole tensor on every rank of the mesh: partial values reduced, shards gathered
        (padding dropped). A new tensor; this one is unchanged."""
        spec = self._dtensor_spec
        local = self.to_local()
        for mesh_dim, placement in enumerate(spec.placements):
            if isinstance(placement, Partial):
                local = _all_reduce(local, placement.reduce_op, spec.mesh, mesh_dim)
        for mesh_dim, placement in enumerate(spec.placements):
            if isinstance(placement, Shard):
                local = _gather(local, placement.dim, spec, mesh_dim)
        return local

    def redistribute(self, device_mesh: Optional[DeviceMesh] = None,
                     placements: Optional[Sequence[Placement]] = None) -> "DTensor":
        """The same tensor with ``placements`` on the same mesh. Per mesh dim: Partial ->
        Replicate all-reduces, Shard -> Replicate all-gathers, Replicate -> Shard keeps this
        rank's chunk; any other change, or another mesh, is refused by name."""
        spec = self._dtensor_spec
        if device_mesh is not None and device_mesh != spec.mesh:
            refuse("DTensor.redistribute onto another mesh", DTENSOR_LAYOUTS)
        target = tuple(placements) if placements is not None else spec.placements
        if len(target) != spec.mesh.ndim:
            raise InvalidArgumentError(
                f"redistribute got {len(target)} placements for a {spec.mesh.ndim}-D mesh")
        local = self.to_local()
        for mesh_dim, (source, goal) in enumerate(zip(spec.placements, target)):
            if source == goal:
                continue
            if isinstance(source, Partial) and isinstance(goal, Replicate):
                local = _all_reduce(local, source.reduce_op, spec.mesh, mesh_dim)
            elif isinstance(source, Shard) and isinstance(goal, Replicate):
                local = _gather(local, source.dim, spec, mesh_dim)
            elif isinstance(source, Replicate) and isinstance(goal, Shard):
                local = _chunk(local, goal.dim, spec, mesh_dim)
            else:
                refuse(f"DTensor.redistribute from {source} to {goal}", DTENSOR_LAYOUTS)
        return DTensor(local, spec.mesh, target, shape=spec.global_shape)

    def __repr__(self) -> str:
        if "_dtensor_local" not in self.__dict__:
            return super().__repr__()
        spec = self._dtensor_spec
        return (f"DTensor(global_shape={spec.global_shape}, placements={spec.placements}, "
                f"mesh={spec.mesh!r})")


class _ManagedTensorOps:
    """What a managed tensor's class puts before its MindSpore class.

    ``mul_``: mindformers clips gradients with ``grad.to_local().mul_(scale)``; on the CPU
    backend ``Tensor.mul_`` returns a new tensor and leaves the tensor unchanged (silently), so
    there the product is written back into the tensor's own memory."""

    def mul_(self, other):
        from gradpool import device_target, overwrite
        from mindspore import mint

        if device_target() != "CPU":
            return super().mul_(other)
        overwrite(self.reshape(-1), mint.mul(self, other).reshape(-1))
        return self


class _ManagedParameterOps(_ManagedTensorOps):
    """A managed parameter's ``main_grad`` is a DTensor with the parameter's own layout, however
    it is set (the first reduced shard that lands, a sum on the CPU path, ``None`` to drop it).

    It costs memory only once it holds something: with a default set
    (:func:`set_main_grad_default`, ``fully_shard``'s main_grad mode), reading ``main_grad``
    while nothing is held makes the default (zeros) then and keeps it, so a unit that did not
    run in a step still gives the optimizer a gradient; the reduce path reads what is held with
    :func:`held_main_grad`, which allocates nothing."""

    @property
    def main_grad(self):
        held = self.__dict__.get("_dtensor_main_grad")
        if held is None:
            default = self.__dict__.get("_dtensor_main_grad_default")
            if default is not None:
                self.main_grad = default()
                held = self.__dict__["_dtensor_main_grad"]
        return held

    @main_grad.setter
    def main_grad(self, value) -> None:
        if value is not None and not isinstance(value, DTensor):
            as_managed_dtensor(value, self._dtensor_spec)
        self.__dict__["_dtensor_main_grad"] = value


def held_main_grad(tensor):
    """What ``tensor.main_grad`` holds in memory now (None: nothing), without making its
    default: the reduce path's read, so that a first landing allocates main_grad itself."""
    if isinstance(tensor, _ManagedParameterOps):
        return tensor.__dict__.get("_dtensor_main_grad")
    return getattr(tensor, "main_grad", None)


def set_main_grad_default(tensor, default) -> None:
    """``default()`` (or None: no default) is what reading ``tensor.main_grad`` makes and keeps
    while it holds nothing; ``tensor`` is a Parameter, managed now or later."""
    tensor.__dict__["_dtensor_main_grad_default"] = default


_MANAGED_CLASSES: dict = {}


def as_managed_dtensor(tensor, spec: DTensorSpec):
    """Make ``tensor`` (a MindSpore ``Parameter`` or ``Tensor`` holding this rank's padded
    shard) a DTensor laid out as ``spec``, in place, and return it. Its memory, identity and
    MindSpore class are kept (it stays an instance of that class); a Parameter's existing
    ``main_grad`` is made a DTensor with it."""
    if tuple(tensor.shape) != spec.local_shape:
        raise InvalidArgumentError(
            f"a local shard of shape {tuple(tensor.shape)} does not fit {spec}: its local shape "
            f"is {spec.local_shape}")
    base = type(tensor)
    if not isinstance(tensor, DTensor):
        from mindspore import Parameter
        ops = _ManagedParameterOps if isinstance(tensor, Parameter) else _ManagedTensorOps
        cls = _MANAGED_CLASSES.get(base)
        if cls is None:
            # Named as MindSpore names it: some MindSpore code reads the class name.
            cls = _MANAGED_CLASSES[base] = type(base.__name__, (ops, base, DTensor),
                                                {"__module__": base.__module__})
        main_grad = tensor.__dict__.pop("main_grad", None) if ops is _ManagedParameterOps else None
        tensor.__class__ = cls
        tensor.__dict__["_dtensor_spec"] = spec
        if ops is _ManagedParameterOps:
            tensor.main_grad = main_grad
    else:
        tensor.__dict__["_dtensor_spec"] = spec
    return tensor


class SkipDTensorDispatch:
    """``with SkipDTensorDispatch(): ...`` runs ops on local tensors. Here every op already does
    (there is no DTensor op dispatch to skip), so entering it changes nothing, truthfully."""

    def __init__(self, no_skip=None):
        self.no_skip = frozenset(no_skip or ())

    def __enter__(self) -> "SkipDTensorDispatch":
        return self

    def __exit__(self, *exc) -> None:
        return None


distribute_tensor = refused_function("distribute_tensor", DISTRIBUTE_TENSOR, __name__)


# -- collectives over one mesh dim (MindSpore imported on use) ------------------------------------
def _all_reduce(local, reduce_op: str, mesh: DeviceMesh, mesh_dim: int):
    from mindspore import mint, ops
    from mindspore.mint.distributed import all_reduce

    total = mint.mul(local, 1)        # a tensor of its own: the collective writes in place
    group = mesh.get_group(mesh_dim)
    if group is not None:
        op = {"sum": ops.ReduceOp.SUM, "avg": ops.ReduceOp.SUM, "max": ops.ReduceOp.MAX,
              "min": ops.ReduceOp.MIN}[reduce_op]
        all_reduce(total, op=op, group=group)
    if reduce_op == "avg":
        total = mint.div(total, mesh.size(mesh_dim))
    return total


def _gather(local, tensor_dim: int, spec: DTensorSpec, mesh_dim: int):
    """All-gather ``local`` along ``tensor_dim`` over ``mesh_dim`` and drop the padding."""
    from mindspore import mint
    from mindspore.mint.distributed import all_gather

    group = spec.mesh.get_group(mesh_dim)
    if group is None:
        parts = [local]
    else:
        parts = [mint.zeros(tuple(local.shape), dtype=local.dtype)
                 for _ in range(spec.mesh.size(mesh_dim))]
        all_gather(parts, local.contiguous(), group=group)
    whole = mint.cat(parts, dim=tensor_dim)
    length = spec.global_shape[tensor_dim]
    if whole.shape[tensor_dim] != length:
        whole = mint.narrow(whole, tensor_dim, 0, length).contiguous()
    return whole


def _chunk(local, tensor_dim: int, spec: DTensorSpec, mesh_dim: int):
    """This rank's padded chunk of a replicated ``local`` along ``tensor_dim``."""
    from mindspore import mint

    size = spec.mesh.size(mesh_dim)
    length = local.shape[tensor_dim]
    chunk = -(-length // size)
    if chunk * size != length:
        pad_shape = list(local.shape)
        pad_shape[tensor_dim] = chunk * size - length
        local = mint.cat([local, mint.zeros(tuple(pad_shape), dtype=local.dtype)], dim=tensor_dim)
    index = spec.mesh.get_local_rank(mesh_dim)
    return mint.narrow(local, tensor_dim, index * chunk, chunk).contiguous()
