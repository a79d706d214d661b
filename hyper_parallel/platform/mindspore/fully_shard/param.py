"""One managed parameter: its local shard, its all-gather, and upstream's reduce-path methods as
thin views onto its unit's reduce (``HSDPUnitState.reduce``, the unit's one reduce path).

Upstream's reduce path did ``self._grad = grad.to(reduce_dtype).reshape(-1)`` and, after the
collective, ``self._grad.untyped_storage().resize_(0)``; with ``reduce_dtype`` equal to the
gradient's dtype that freed autograd's own gradient. Here the reduce-scatter reads a pool lease
(or, with zero-copy, borrows the gradient until the collective completes) and reading the
output only drops references: nothing in this package resizes storage.

Lifetime of the reduced shard: ``reduced_shard()`` (the unit's own use) is a view of a pool
output bucket, valid until ``clear_reduce_scatter_output()``; what anyone else receives
(upstream's ``reduce_scatter_output()``, ``apply_reduced_grad``, ``main_grad``) is memory of
their own (pool memory never leaves the pool).

``main_grad`` (main_grad mode) holds no memory from ``zero_grad`` until the parameter's first
reduced shard lands, which allocates it (:meth:`MindSporeHSDPParamV2.add_to_main_grad`); read
before that, it is zeros made on the read.
"""
from __future__ import annotations

import hashlib
import zlib
import logging
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, mint

from gradpool import (GradientIntegrityError, GradSlot, InvalidArgumentError, ReduceResult,
                      ReduceScatterLayout, add_in_place, check_in_place_add, check_reduce_op,
                      device_target, fence_queued_work, on_real_device, pack_bucket, row_tails,
                      unpack_gathered, unshard, writable_view, write_row_tails)
from hyper_parallel.core.dtensor.dtensor import held_main_grad, set_main_grad_default
from hyper_parallel.platform.mindspore.fully_shard.meta_init import (install_sharded_init, is_meta,
                                                                      meta_shard)

logger = logging.getLogger(__name__)


@dataclass
class _GradFingerprint:
    """What a gradient looked like when it reached the reduce path."""

    storage_bytes: int
    digest: str


def fingerprint(tensor: ms.Tensor) -> _GradFingerprint:
    data = np.ascontiguousarray(writable_view(tensor).asnumpy())
    return _GradFingerprint(tensor.untyped_storage().size(), hashlib.blake2b(data.tobytes()).hexdigest())


@dataclass
class ReduceSlot:
    """Where this parameter's reduced shard is: entry ``index`` of a (maybe shared) result."""

    result: ReduceResult
    index: int


class MindSporeHSDPParamV2:
    """A parameter managed by ``fully_shard``: sharded along ``shard_dim`` or replicated.

    ``unit`` (set by the unit that adopts it) is the ``HSDPUnitState`` whose reduce path this
    parameter's reduce methods use.

    The record lives as long as its shard (a MindSpore ``Parameter``, which only the garbage
    collector frees: it and its ``ParamInfo`` refer to each other), so it holds its unit and its
    owning cells weakly: a dropped model is freed by reference counting, and its unit's
    finalizer gives back the reduce result this record still points to."""

    def __init__(self, cell, attr_name: str, param: Parameter, *, rank: int, world_size: int,
                 comm, shard_dim: int = 0, replicate: bool = False, mp_policy=None,
                 verify_gradients: bool = False, main_grad_in_place: bool = True):
        # Every (cell, attribute) that holds this parameter: tied weights share one shard.
        self.owners = [(cell, attr_name)]
        self._unit = None
        self.name = param.name
        self.orig_shape = tuple(param.shape)
        self.orig_dtype = param.dtype
        self.rank, self.world_size = rank, world_size
        self.comm = comm
        self.replicate = replicate
        self.shard_dim = shard_dim
        self.param_dtype = getattr(mp_policy, "param_dtype", None)
        self.reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
        self.use_main_grad = bool(getattr(mp_policy, "apply_grad_on_fp32_main_grad", False))
        self.verify_gradients = verify_gradients
        # main_grad accumulates in place where the backend's in-place add works (Ascend; checked
        # once, at the first such add); on CPU ``Tensor.add_`` of a plain tensor returns a new
        # one and leaves it unchanged.
        self._add_in_place = main_grad_in_place and device_target() == "Ascend"
        if not replicate and not 0 <= shard_dim < len(self.orig_shape):
            raise InvalidArgumentError(
                f"parameter {self.name} of shape {self.orig_shape} cannot be sharded on dim "
                f"{shard_dim}")
        self.slot = None if replicate else GradSlot.of(self.orig_shape, world_size, shard_dim)
        self.sharded_param = self._make_local(param)
        self._grad: Optional[ms.Tensor] = None
        self._fingerprint: Optional[_GradFingerprint] = None
        self._slot: Optional[ReduceSlot] = None
        self.partial: Optional[ms.Tensor] = None   # HSDP: shard-group sum, replicas not yet in
        self.verified_gradients = 0     # gradients proven intact after their reduce path

    @property
    def unit(self):
        return None if self._unit is None else self._unit()

    @unit.setter
    def unit(self, unit) -> None:
        self._unit = None if unit is None else weakref.ref(unit)

    @property
    def owners(self) -> list[tuple[Any, str]]:
        """Every live ``(cell, attribute)`` that holds this parameter."""
        return [(cell, attr) for cell, attr in ((ref(), attr) for ref, attr in self._owners)
                if cell is not None]

    @owners.setter
    def owners(self, owners: list[tuple[Any, str]]) -> None:
        self._owners = [(weakref.ref(cell), attr) for cell, attr in owners]

    # -- sharding -------------------------------------------------------------------------------
    @property
    def local_shape(self) -> tuple[int, ...]:
        return self.orig_shape if self.replicate else self.slot.chunk_shape

    def _make_local(self, param: Parameter) -> Parameter:
        """The local shard (a new Parameter; the original itself when replicated). Marks nothing:
        :meth:`adopt` does, once ``fully_shard`` has planned every parameter.

        A lazily initialised parameter (``no_init_parameters()``, an ``initializer(...)``) is
        never materialised whole: only this rank's shard is drawn (:func:`lazy_shard_values`).
        A parameter on the meta device gets a meta shard (:mod:`.meta_init`): ``to_empty()``
        gives it memory, its in-place initialisers fill it."""
        self.built_on_meta = is_meta(param)
        if self.replicate:
            return param.init_data() if is_lazy(param) else param
        if self.built_on_meta:
            return meta_shard(param, self.local_shape)
        if is_lazy(param):
            values = lazy_shard_values(param, self.slot, self.rank)
        else:
            values = host_shard_values(param, self.slot, self.rank)
        # Memory of its own: the optimizer updates the shard in place, and on CPU an in-place
        # write into a view at a non-zero offset would silently not land.
        local = ms.Tensor(values)
        if local.dtype != param.dtype:
            local = local.astype(param.dtype)
        return Parameter(local, name=param.name, requires_grad=param.requires_grad)

    def adopt(self, original: Parameter) -> None:
        """Mark the shard and the original as managed (the commit step of ``fully_shard``)."""
        self.sharded_param.main_grad = None      # allocated when a gradient lands
        set_main_grad_default(self.sharded_param, self.zero_main_grad if self.use_main_grad
                              else None)
        self.sharded_param.hsdp_param = self
        original.hsdp_managed_by = self    # so another unit will not shard it again
        if not self.replicate:
            install_sharded_init(self)     # normal_() & co. initialise the full parameter

    def unsharded(self, local: ms.Tensor) -> ms.Tensor:
        """All-gather ``local`` (this rank's shard) into the full parameter, in ``param_dtype``."""
        return launch_all_gather([self], [local], None, fused=False).wait()[0]

    def in_param_dtype(self, full: ms.Tensor) -> ms.Tensor:
        """``full`` cast to the compute dtype (``param_dtype``) when one is set."""
        if self.param_dtype is not None and full.dtype != self.param_dtype:
            full = full.astype(self.param_dtype)
        return full

    # -- reduce path (upstream names and meaning) ------------------------------------------------
    def reduce_comm_dtype(self, grad: Optional[ms.Tensor] = None):
        """The dtype this parameter's gradient is communicated in."""
        if self.reduce_dtype is not None:
            return self.reduce_dtype
        if grad is not None:
            return grad.dtype
        return self.param_dtype or self.orig_dtype

    def set_unsharded_grad(self, grad: ms.Tensor) -> None:
        """Take a gradient for the reduce path (upstream's per-parameter call; the unit's own
        backward uses :meth:`take_gradient`). A reduce of this unit still in flight
        (asynchronous reduce) lands in main_grad first."""
        if tuple(grad.shape) != self.orig_shape:
            raise InvalidArgumentError(
                f"gradient of {self.name} has shape {tuple(grad.shape)}, expected {self.orig_shape}")
        if self.unit is not None:
            self.unit.finish_async_reduce()
        self.take_gradient(grad)

    def take_gradient(self, grad: ms.Tensor) -> None:
        """Hold autograd's gradient (by reference only, never freed) until its reduce read it."""
        self._grad = grad
        self._fingerprint = fingerprint(grad) if self.verify_gradients else None

    @property
    def unsharded_grad(self) -> Optional[ms.Tensor]:
        """The gradient as the reducer takes it (a 0-d replicated one as one element)."""
        if self._grad is not None and self._grad.ndim == 0:
            return self._grad.reshape(1)
        return self._grad

    def reduce_scatter_grad(self, async_op: bool = True, reduce_op: str = "avg",
                            output_buffer: Optional[ms.Tensor] = None) -> None:
        """Launch this parameter's reduce-scatter (all-reduce when replicated) on pool memory,
        through its unit's reduce path.

        ``output_buffer`` is accepted for upstream compatibility; the output always lives in a
        pool bucket, so a given buffer is refused rather than silently ignored."""
        check_reduce_op(reduce_op)
        if output_buffer is not None:
            raise InvalidArgumentError(
                "output_buffer is not supported: reduce outputs are pool buckets; pass None")
        if self._grad is None:
            raise InvalidArgumentError(f"{self.name} has no gradient to reduce; call "
                                       "set_unsharded_grad() first")
        self.unit.reduce([self], reduce_op)
        if not async_op:
            self._slot.result.wait()

    def attach_result(self, result: ReduceResult, index: int) -> None:
        """Adopt entry ``index`` of a (maybe fused) reduction as this parameter's output."""
        self.clear_reduce_scatter_output()
        self._slot = ReduceSlot(result, index)

    def reduce_scatter_output(self) -> Optional[ms.Tensor]:
        """Wait for the collective and return the reduced local shard, as a tensor of the
        caller's own (pool memory never leaves the pool: the output bucket goes back at
        :meth:`clear_reduce_scatter_output` or the next reduce, and is reused)."""
        shard = self.reduced_shard()
        return None if shard is None else owned_copy(shard, shard.dtype)

    def reduced_shard(self) -> Optional[ms.Tensor]:
        """Wait for the collective and return the reduced local shard as a view of its pool
        bucket, for the unit's own use before the bucket goes back.

        The input was a pool lease, released fenced on the collective at launch and so recycled
        by the pool, or a borrowed gradient whose reference is dropped here. Nothing is freed."""
        if self._slot is None:
            return None
        shard = self._slot.result.wait()[self._slot.index]
        if tuple(shard.shape) != self.local_shape:      # a 0-d parameter, reduced as (1,)
            shard = shard.reshape(self.local_shape)
        self._check_gradient_intact()
        self._grad = None
        return shard

    def finish_local_use(self) -> None:
        """The gradient was packed into a pool bucket (a no-sync micro-step); drop it."""
        self._check_gradient_intact()
        self._grad = None

    finish_reduce_input = finish_local_use     # its reduce has read it: verify, then drop

    def reduce_in_flight(self) -> bool:
        """This parameter's reduce result is launched and its collective not completed yet."""
        return self._slot is not None and not self._slot.result.is_completed()

    def drop_gradient(self) -> None:
        """Forget autograd's gradient without checking it (its reduce result was settled)."""
        self._grad = None
        self._fingerprint = None

    def clear_reduce_scatter_output(self) -> None:
        """Return the output bucket to the pool (shared fused results are released once)."""
        if self._slot is not None:
            self._slot.result.release()
            self._slot = None

    def apply_reduced_grad(self, reduced: ms.Tensor) -> ms.Tensor:
        """The gradient autograd gets for the local shard: a tensor of its own (never a view of
        the pool bucket ``reduced`` may live in), in the shard's dtype (without main_grad: the
        unit returns it from backward; with ``apply_grad_on_fp32_main_grad`` the unit adds the
        shard into ``main_grad`` instead and returns zeros)."""
        grad = owned_copy(reduced, self.orig_dtype)
        if self.use_main_grad:
            self.add_to_main_grad(reduced)
        return grad

    @property
    def main_grad_held(self) -> Optional[ms.Tensor]:
        """What ``main_grad`` holds in memory now, without allocating: None from ``zero_grad``
        (and ``fully_shard``) until the first reduced shard lands."""
        return held_main_grad(self.sharded_param)

    def add_to_main_grad(self, reduced: ms.Tensor, owned: bool = False) -> None:
        """``main_grad += reduced`` in float32; ``owned``: ``reduced`` is a tensor of its own (a
        scaled shard), not a view of a pool bucket.

        The first landing since ``zero_grad`` allocates ``main_grad``: a float32 copy out of the
        pool bucket (or ``reduced`` itself when owned and float32), not zeros made earlier and
        added into, so ``main_grad`` costs no memory through forward and backward until its
        gradient exists. ``main_grad`` never aliases the pool bucket ``reduced`` lives in (the
        bucket goes back to the pool right after). Later landings (micro-steps) accumulate: in
        place, on Ascend with ``Tensor.add_`` (checked once that it takes effect), on the CPU
        through host memory (:func:`gradpool.add_in_place`: there ``add_`` of a plain tensor
        silently leaves it unchanged); a new tensor only where neither applies."""
        main = self.main_grad_held
        if main is None:
            self.sharded_param.main_grad = reduced if owned and reduced.dtype == ms.float32 \
                else owned_copy(reduced, ms.float32)
            return
        addend = reduced if reduced.dtype == ms.float32 else reduced.astype(ms.float32)
        if self._add_in_place:
            check_in_place_add()
            main.add_(addend)
        elif not add_in_place(main, addend):
            self.sharded_param.main_grad = mint.add(main, addend)

    def launched(self) -> None:
        """The reduce of this gradient is in flight (asynchronous reduce): the reducer has copied
        it into a pool bucket (or borrows it until the collective completes), so the reference is
        dropped now; with ``verify_gradients`` it is kept, to be checked when the result is used."""
        if self._fingerprint is None:
            self._grad = None

    def zero_grad(self) -> None:
        """Drop the gradient, and the shard's torch-style ``grad`` (``loss.backward()``
        accumulates there); ``main_grad`` holds no memory again until a gradient lands (main_grad
        mode: read before that, it is zeros, made then, so a unit that does not run in a step
        still gives the optimizer a gradient)."""
        self.clear_reduce_scatter_output()
        self._grad = None
        self.sharded_param._grad = None
        self.sharded_param.main_grad = None

    def zero_main_grad(self) -> ms.Tensor:
        """float32 zeros of the local shard's shape: ``main_grad`` read before any landing (on the
        real device, should it be read inside ``ms.DeviceCtx("meta")``)."""
        with on_real_device():
            return mint.zeros(self.local_shape, dtype=ms.float32)

    def _check_gradient_intact(self) -> None:
        if self._fingerprint is None or self._grad is None:
            return
        now = fingerprint(self._grad)
        if now.storage_bytes != self._fingerprint.storage_bytes:
            raise GradientIntegrityError(
                f"the gradient of {self.name} lost its storage during the reduce path "
                f"({self._fingerprint.storage_bytes} -> {now.storage_bytes} bytes)")
        if now.digest != self._fingerprint.digest:
            raise GradientIntegrityError(
                f"the gradient of {self.name} was changed during the reduce path")
        self._fingerprint = None
        self.verified_gradients += 1

    def __repr__(self) -> str:
        kind = "replicated" if self.replicate else f"Shard({self.shard_dim})"
        return f"MindSporeHSDPParamV2({self.name}, {self.orig_shape}, {kind})"


def owned_copy(tensor: ms.Tensor, dtype) -> ms.Tensor:
    """``tensor`` in ``dtype`` as a new tensor of its own: a cast writes one; to the same dtype
    ``astype`` would return ``tensor`` itself, so it is multiplied by 1 (exact, out of place)."""
    if tensor.dtype != dtype:
        return tensor.astype(dtype)
    return mint.mul(tensor, 1)


# -- the local shard of a parameter ----------------------------------------------------------
def is_lazy(param: Parameter) -> bool:
    """``param`` has an initializer and no data yet (MindSpore's lazy initialisation)."""
    return bool(getattr(param, "has_init", False)) and getattr(param, "init", None) is not None


def _valid_index(slot: GradSlot, rank: int, start: int) -> tuple:
    """The index of the real (unpadded) part of ``rank``'s chunk: in the full tensor when
    ``start`` is the chunk's offset there, in the chunk when it is 0."""
    index = [slice(None)] * len(slot.shape)
    index[slot.shard_dim] = slice(start, start + slot.valid_length(rank))
    return tuple(index)


def host_shard_values(param: Parameter, slot: GradSlot, rank: int) -> np.ndarray:
    """``rank``'s chunk of a materialised parameter, zero-padded, as a new host array (one
    copy of the chunk: on CPU ``asnumpy()`` is the parameter's own memory)."""
    full = param.asnumpy()
    local = np.zeros(slot.chunk_shape, dtype=full.dtype)
    local[_valid_index(slot, rank, 0)] = full[_valid_index(slot, rank, rank * slot.chunk_size)]
    return local


def shard_seed(name: str, rank: int) -> int:
    """The seed a lazily initialised shard is drawn with: from ``mindspore.get_seed()`` (0 when
    unset), the parameter's name (so two parameters never draw the same numbers) and the shard's
    index in its shard group."""
    sequence = np.random.SeedSequence([ms.get_seed() or 0, zlib.crc32(name.encode()), rank])
    return int(sequence.generate_state(1)[0])


def lazy_shard_values(param: Parameter, slot: GradSlot, rank: int) -> np.ndarray:
    """``rank``'s chunk of a lazily initialised parameter, drawn without the full tensor.

    As in MindSpore's own sliced initialisation (``Tensor.init_data(slice_index=..., shape=...)``,
    what its auto-parallel mode does), the parameter's initializer runs on the real part of the
    chunk's shape, with NumPy's global generator (which MindSpore's random initializers draw
    from) seeded by :func:`shard_seed`; the padding is zero. So a constant initializer (``Zero``,
    ``One``, ``Constant``) gives exactly the unsharded parameter's slice; a random one gives draws
    of the same family, fixed for a seed, a name and a world size, equal across HSDP replicas of a
    shard (same index), but not the values an unsharded init would put there (those need the
    whole tensor drawn in order). An initializer whose scale depends on the shape (He, Xavier: the
    fans) computes it from the chunk's shape, as MindSpore's sliced init does; that equals the
    full shape's fan when the sharded dim is not a fan dim (``Shard(0)`` with ``mode='fan_in'``).
    Drawn in float32 (the dtype MindSpore's random initializers fill in place), then cast."""
    local = np.zeros(slot.chunk_shape, dtype=np.float32)
    valid = _valid_index(slot, rank, 0)
    if slot.valid_length(rank) > 0:
        shape = list(slot.chunk_shape)
        shape[slot.shard_dim] = slot.valid_length(rank)
        drawn = np.zeros(shape, dtype=np.float32)
        state = np.random.get_state()
        np.random.seed(shard_seed(param.name, rank))
        try:
            param.init(drawn)
        finally:
            np.random.set_state(state)
        local[valid] = drawn
    return local


# -- one unit's all-gather -------------------------------------------------------------------------
class PendingGather:
    """A unit's all-gathers, launched (``async_op=True``); :meth:`wait` gives the full parameters
    (in ``param_dtype``), once. Forward prefetch launches one early and its unit waits on it when
    its forward starts; without prefetch a unit launches and waits at once."""

    def __init__(self, count: int):
        self._fulls: list = [None] * count
        self._pending: list = []      # (indices, finish(): full tensors, abandon())

    def add(self, indices: list, finish, abandon) -> None:
        """One launched gather of the parameters at ``indices``: ``finish()`` waits and returns
        their full tensors, settling its buckets either way; ``abandon()`` settles them unwaited."""
        self._pending.append((indices, finish, abandon))

    def wait(self, sink=None) -> tuple:
        """The full parameters; ``sink(index, full)``, when given, takes each as soon as its
        gather is done and returns what stands for it (a unit writes it into its buffer), so the
        fresh tensors of a unit's gathers are not all alive at once."""
        try:
            while self._pending:
                indices, finish, _ = self._pending.pop(0)   # finish() settles its own buckets
                for index, full in zip(indices, finish()):
                    self._fulls[index] = full if sink is None else sink(index, full)
        except BaseException:
            self.abandon()
            raise
        return tuple(self._fulls)

    def abandon(self) -> None:
        """Give back the gather buckets of what was not waited (fenced on its collective)."""
        pending, self._pending = self._pending, []
        for _, _, abandon in pending:
            abandon()


def launch_all_gather(params: list, locals_: list, pool, *, fused: bool,
                      host: bool = True, buffers: Optional[list] = None,
                      tag=None) -> PendingGather:
    """Launch the all-gathers that make the full parameters of one unit from their local shards
    (``pool`` gives the fused gathers their buckets; None will do when not ``fused``).

    ``fused`` (``comm_fusion=True``, like upstream's fused all-gather and PyTorch FSDP2's
    ``foreach_all_gather``): **one all-gather per local dtype** for all the unit's sharded
    parameters, on pool buckets. Each rank packs its shards as one row of the parameters'
    :class:`ReduceScatterLayout` (``gradpool.pack.pack`` at world size 1: the same offsets and
    alignment as a reduce bucket), all-gathers the rows into a ``[W, row]`` bucket, and each full
    parameter is copied out of it (``gradpool.pack.unpack_gathered``, chunk geometry by
    ``unshard``). Not fused: one all-gather per parameter.

    Lifetime (why copy out): the full parameters never alias a gather bucket, so the buckets go
    back to the pool as soon as the copies are done (the send bucket at launch, fenced on the
    collective), and the next unit's gather or a reduce can reuse them while autograd still
    holds this unit's parameters for backward. Keeping the lease until the unit's backward
    instead would hold every unit's gather bucket for the whole step (they all overlap between
    forward and backward) and leak one when a forward has no backward. The cost is one copy of
    the gathered bytes, small next to a CPU collective.

    ``buffers`` (a unit's :class:`gradpool.GatheredParam` per parameter, or None): a parameter
    gathered alone whose gathered rows are its full tensor as they are (sharded on dim 0, no
    padding, no cast) is gathered straight into its buffer, with no copy and no memory of its
    own; its ``finish`` returns the buffer's tensor, filled.

    ``tag`` (the unit's order tag, :class:`.order_flag.UnitTag`, or None): one of the gathers
    carries it in a tail of every rank's row, compared on the device once gathered: the first
    fused bucket, or unfused the smallest parameter's gather (the larger ones keep gathering in
    place)."""
    pending = PendingGather(len(params))
    groups: dict = {}
    gathered = [i for i, p in enumerate(params) if not (p.replicate or p.world_size == 1)]
    tagged = None if tag is None or fused or not gathered else \
        min(gathered, key=lambda i: params[i].slot.chunk_numel)
    try:
        for index, (param, local) in enumerate(zip(params, locals_)):
            if param.replicate or param.world_size == 1:
                full = param.in_param_dtype(local)     # nothing to gather, and no padding
                pending.add([index], lambda full=full: [full], lambda: None)
            elif fused:
                groups.setdefault(local.dtype, []).append(index)
            elif index == tagged:
                pending.add([index], *_launch_one_gather(param, local, tag=tag))
            else:
                buffer = buffers[index] if buffers is not None else None
                into = buffer if buffer is not None and gathers_in_place(param, local, buffer) \
                    else None
                pending.add([index], *_launch_one_gather(param, local, into))
        for position, (dtype, indices) in enumerate(groups.items()):
            members = [params[i] for i in indices]
            pending.add(indices, *_launch_bucket_gather(
                members, [locals_[i] for i in indices], dtype, pool, host,
                tag if position == 0 else None))
    except BaseException:
        pending.abandon()
        raise
    return pending


def gathers_in_place(param: MindSporeHSDPParamV2, local: ms.Tensor, buffer) -> bool:
    """Whether every rank's chunk, concatenated, is ``param``'s full tensor in ``buffer``'s dtype
    as it is (no reordering, no padding, no cast), so the all-gather can write the buffer."""
    return (param.shard_dim == 0 and param.slot.shard_padding_numel == 0
            and local.dtype == buffer.dtype)


def _launch_one_gather(param: MindSporeHSDPParamV2, local: ms.Tensor, into=None, tag=None):
    """One parameter's all-gather (into its buffer's memory when ``into`` is given); with
    ``tag``, each rank's row is its chunk followed by the tag's values."""
    numel = param.slot.chunk_numel
    send = local.reshape(numel)
    row = numel
    if tag is not None:
        send = mint.cat([send, tag.values(send.dtype)])
        row += tag.numel
    gathered = (mint.empty(row * param.world_size, dtype=local.dtype) if into is None
                else into.target())
    handle = param.comm.all_gather(gathered, send, async_op=True)

    def finish() -> list:
        handle.wait()
        if into is not None:
            return [into.filled()]
        flat = gathered
        if tag is not None:
            rows = gathered.view(param.world_size, row)
            tag.check_gathered(rows[:, numel:])
            flat = rows[:, :numel].contiguous().view(numel * param.world_size)
        return [param.in_param_dtype(unshard(flat, param.slot))]

    def abandon() -> None:
        # the collective may still write into ``gathered``: it must outlive it
        try:
            handle.wait()
        except Exception:  # noqa: BLE001 - abandoned because something else failed first
            logger.warning("an abandoned all-gather of %s failed too", param.name)

    return finish, abandon


def _launch_bucket_gather(members: list, locals_: list, dtype, pool, host: bool, tag=None):
    """One all-gather of ``members``' local shards through two pool leases (send row, gathered
    ``[W, row]``): the send bucket is released at launch, fenced on the collective; the gathered
    one when its full tensors have been copied out (they own their memory). ``tag``: every row
    ends with the tag's values, compared on the device once gathered."""
    comm = members[0].comm
    align = pool.alignment_elements(dtype)
    tail = 0 if tag is None else tag.numel
    layout = ReduceScatterLayout.build([m.orig_shape for m in members], comm.world_size, align,
                                       [m.shard_dim for m in members], tail)
    row = ReduceScatterLayout.build([m.local_shape for m in members], 1, align, tail_numel=tail)
    taken: list = []
    handle = None
    try:
        send = pool.acquire(row.total_numel, dtype, holder=taken)
        written = pack_bucket(send, locals_, row, host=host)
        if tag is not None:
            write_row_tails(send.tensor, row, tag.values(dtype), send.allocation)
        recv = pool.acquire(layout.total_numel, dtype, holder=taken)
        handle = comm.all_gather(recv.tensor, send.tensor, async_op=True)
    except BaseException:
        for lease in taken:
            lease.release(handle)
        raise
    send.release(handle)

    def finish() -> list:
        copied_out = None
        try:
            handle.wait()
            if tag is not None:
                tag.check_gathered(row_tails(recv.tensor, layout))
            fulls = unpack_gathered(recv, layout, host=host)
            if not (written.on_host and host):
                # queued device copies still read the bucket: it is recycled once they have run
                # (on Ascend an event after them, no host wait; on CPU a drain of the queue)
                copied_out = fence_queued_work()
        finally:
            # the collective is complete here, or failed: over as far as memory goes
            recv.release(handle if copied_out is None else copied_out)
        return [m.in_param_dtype(full) for m, full in zip(members, fulls)]

    def abandon() -> None:
        recv.release(handle)

    return finish, abandon
