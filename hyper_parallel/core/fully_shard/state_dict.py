"""State dicts of a ``fully_shard`` model and its optimizer, full or sharded (upstream's names).

Every tensor of the state is a :class:`StateEntry`: the rank's local tensor (the padded shard a
``fully_shard`` parameter holds, or a whole tensor) and the box of the global tensor it holds
unpadded. The optimizer's states follow their parameter: ``moment1.<name>`` of a sharded
parameter is sharded like it (MindSpore 2.10 optimizers name their states ``<state>.<name>``,
shaped like the parameter they were built on, which here is the local shard); everything else
(``global_step``, ``beta1_power``, the learning rate) is whole and the same on every rank.

``full_state_dict=True`` gathers each sharded tensor in its own shard group (HSDP replicas hold
the same shard, so nothing is counted twice) and gives plain tensors under the unsharded model's
names, identical on every rank; a tensor only some ranks hold (an expert under expert
parallelism) is sent to the others by its first holder (:mod:`.held_by_some`). ``full_state_dict=False`` gives each rank its unpadded shards as
:class:`ShardedTensor` (what a distributed checkpoint writes) and its whole tensors as they are.
``set_*`` takes either form: each rank takes the part its own layout needs; a sharded dict made
at another world size or mesh lacks parts and is refused (load a checkpoint to reshard).

Keys are parameter paths in the model (``parameters_and_names()``): the unsharded model's
``parameters_dict()`` names, unless MindSpore renamed a parameter after it was built (slicing a
``CellList`` inside ``construct`` does). Per-parameter optimizer states are keyed
``<state attribute>.<parameter path>`` (``moment1.layers.0.attn.q``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import mindspore as ms
import ml_dtypes
import numpy as np
from mindspore import mint

from gradpool import InvalidArgumentError, StateMismatchError, unshard
from hyper_parallel.core.dtensor.boxes import Box, plan_reads, shard_box
from hyper_parallel.core.fully_shard.held_by_some import share_full_tensors, world_keys

__all__ = ["ShardedTensor", "StateEntry", "model_entries", "optimizer_entries",
           "get_model_state_dict", "set_model_state_dict", "get_optimizer_state_dict",
           "set_optimizer_state_dict", "to_numpy"]


@dataclass(frozen=True)
class ShardedTensor:
    """One rank's unpadded part of a tensor of ``global_shape``, starting at ``offsets``."""

    local: ms.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    @property
    def box(self) -> Box:
        return Box(tuple(self.offsets), tuple(self.local.shape))


def to_numpy(tensor: ms.Tensor) -> np.ndarray:
    """A host copy of ``tensor`` (bfloat16 as ``ml_dtypes.bfloat16``: the same bits)."""
    array = np.array(tensor.asnumpy())          # on CPU asnumpy() is the tensor's memory: copy
    if tensor.dtype == ms.bfloat16:
        array = array.view(np.uint16).view(ml_dtypes.bfloat16)
    return array


def dtype_name(dtype) -> str:
    return str(dtype).lower()


def host_dtype(dtype) -> np.dtype:
    """The NumPy dtype :func:`to_numpy` gives a tensor of MindSpore ``dtype``."""
    return np.dtype(ml_dtypes.bfloat16 if dtype == ms.bfloat16 else ms.dtype_to_nptype(dtype))


def assemble(box: Box, reads: list, read_part: Callable[[int, Box], np.ndarray],
             dtype) -> np.ndarray:
    """The values of ``box`` from the parts :func:`plan_reads` chose: ``read_part(piece index,
    part)`` gives a part's values, an array the result may share. A single part that is the
    whole box is returned as read (no copy)."""
    if len(reads) == 1 and reads[0][1] == box:
        return read_part(*reads[0])
    values = np.zeros(box.lengths, dtype=dtype)
    for index, part in reads:
        values[part.slices(box)] = read_part(index, part)
    return values


@dataclass
class StateEntry:
    """One tensor of the state on this rank.

    ``tensor``: the Parameter holding it here (padded along ``shard_dim`` when sharded);
    ``box``: the unpadded part of the global tensor it holds; ``writes``: this rank is the one
    that saves that part (HSDP replicas and whole tensors are saved once)."""

    name: str
    tensor: ms.Parameter
    global_shape: tuple[int, ...]
    box: Box
    writes: bool
    managed: Optional[object] = None      # the MindSporeHSDPParamV2 it is sharded like

    @property
    def sharded(self) -> bool:
        return self.managed is not None

    @property
    def dtype(self) -> str:
        return dtype_name(self.tensor.dtype)

    def _local_index(self) -> tuple:
        return tuple(slice(0, n) for n in self.box.lengths) if self.sharded else ()

    def local_values(self, copy: bool = True) -> np.ndarray:
        """The unpadded part this rank holds, as a host copy; ``copy=False``: where the backend
        allows, a read-only view of the tensor's own memory, valid until the tensor changes."""
        if copy:
            values = to_numpy(self.tensor)
        else:
            values = self.tensor.asnumpy()
            if self.tensor.dtype == ms.bfloat16:
                values = values.view(np.uint16).view(ml_dtypes.bfloat16)
        return np.ascontiguousarray(values[self._local_index()]) if self.sharded else values

    def full(self) -> ms.Tensor:
        """The global tensor (every rank of the shard group must call this, in the same order)."""
        if not self.sharded:
            return self.tensor.copy()
        managed = self.managed
        numel = managed.slot.chunk_numel
        gathered = mint.empty(numel * managed.world_size, dtype=self.tensor.dtype)
        managed.comm.all_gather(gathered, self.tensor.reshape(numel)).wait()
        return unshard(gathered, managed.slot).contiguous()

    def assign(self, values: np.ndarray) -> None:
        """Make ``values`` (the unpadded part :attr:`box`, a NumPy array this call may keep)
        this rank's tensor; padding is zero."""
        shape = tuple(self.tensor.shape)
        if self.sharded and tuple(values.shape) != shape:
            local = np.zeros(shape, dtype=values.dtype)
            local[self._local_index()] = values
            values = local
        values = values.reshape(shape)
        if not (values.flags.c_contiguous and values.flags.writeable):
            values = values.copy()      # (np.ascontiguousarray would make a 0-d array 1-d)
        self.tensor.set_data(ms.from_numpy(values))


def _world_rank() -> int:
    from gradpool import init_distributed
    return init_distributed()[0]


def _entry_for(name: str, tensor, managed, rank: int) -> StateEntry:
    if managed is None or managed.replicate:
        shape = tuple(tensor.shape)
        return StateEntry(name, tensor, shape, Box.whole(shape), writes=rank == 0)
    slot = managed.slot
    replicate_comm = managed.unit.reducer.replicate_comm if managed.unit is not None else None
    first_replica = replicate_comm is None or replicate_comm.rank == 0
    box = shard_box(managed.orig_shape, managed.shard_dim, slot.chunk_size, managed.rank)
    return StateEntry(name, tensor, managed.orig_shape, box, writes=first_replica and box.numel > 0,
                      managed=managed)


def _param_names(model) -> dict[int, str]:
    """``{id(parameter): its path in model}``: keys that stay put when MindSpore renames a
    parameter (slicing a ``CellList`` inside ``construct`` re-prefixes its cells' names)."""
    return {id(param): name for name, param in model.parameters_and_names()}


def model_entries(model) -> list[StateEntry]:
    """Every parameter of ``model`` under its path (the same order on every rank)."""
    rank = _world_rank()
    return [_entry_for(name, param, getattr(param, "hsdp_param", None), rank)
            for name, param in model.parameters_and_names()]


def _per_parameter_states(optimizer) -> list[tuple[str, tuple]]:
    """``(attribute, states)`` of each tuple of per-parameter states (``moment1``, ``accum``, ...):
    MindSpore 2.10's optimizers keep one ParameterTuple per state, entry ``i`` for parameter
    ``i`` of ``optimizer.parameters``."""
    params = tuple(optimizer.parameters)
    found = []
    for attr, value in vars(optimizer).items():
        if attr in ("parameters", "_parameters") or not isinstance(value, ms.ParameterTuple):
            continue
        if len(value) == len(params) and all(tuple(s.shape) == tuple(p.shape)
                                             for s, p in zip(value, params)):
            found.append((attr, tuple(value)))
    return found


def optimizer_entries(model, optimizer) -> list[StateEntry]:
    """Every state of ``optimizer``: per-parameter states as ``<state>.<parameter path>``,
    sharded like their parameter; the rest (``global_step``, powers, learning rate) whole,
    under their own names."""
    rank = _world_rank()
    paths = _param_names(model)
    params = tuple(optimizer.parameters)
    entries, covered = [], {id(p) for p in params}
    for attr, states in _per_parameter_states(optimizer):
        for param, state in zip(params, states):
            covered.add(id(state))
            path = paths.get(id(param), param.name)
            entries.append(_entry_for(f"{attr}.{path}", state, getattr(param, "hsdp_param", None),
                                      rank))
    for name, state in optimizer.parameters_and_names():
        if id(state) not in covered and id(state) not in paths:
            entries.append(_entry_for(name, state, None, rank))
    return entries


def _state_dict(entries: list[StateEntry], full: bool) -> dict:
    if full:        # tensors only some ranks hold (experts) come from their holders
        return share_full_tensors({e.name: e.full() for e in entries})
    return {e.name: ShardedTensor(ms.Tensor(e.local_values()), e.global_shape, e.box.offsets)
            if e.sharded else e.tensor.copy() for e in entries}


def _check_keys(entries: list[StateEntry], state_dict: Mapping, what: str) -> None:
    if not isinstance(state_dict, Mapping):
        raise InvalidArgumentError(f"{what} must be a dict of name -> tensor, got "
                                   f"{type(state_dict).__name__}")
    names = [e.name for e in entries]
    missing = [n for n in names if n not in state_dict]
    if missing:
        raise StateMismatchError(f"{what} has no {missing[0]!r} ({len(missing)} keys missing); "
                                 f"the model needs every one of {len(names)} keys")
    # a key this rank does not hold is expected when another rank holds it (experts)
    known = set(world_keys({e.name: (e.global_shape, e.dtype) for e in entries}))
    unexpected = [k for k in state_dict if k not in known]
    if unexpected:
        raise StateMismatchError(f"{what} has {unexpected[0]!r}, which the model does not have "
                                 f"({len(unexpected)} unexpected keys)")


def _pieces(name: str, value) -> tuple[tuple, str, list[tuple[Box, object]]]:
    """(global shape, dtype name, [(box, values)]) of one state-dict value: a whole tensor, one
    ShardedTensor, or a list of ShardedTensors of one tensor (e.g. every rank's of another world
    size: then each rank takes its part of them)."""
    if isinstance(value, ShardedTensor):
        return tuple(value.global_shape), dtype_name(value.local.dtype), [(value.box, value.local)]
    if isinstance(value, (list, tuple)) and value \
            and all(isinstance(v, ShardedTensor) for v in value):
        kinds = {(tuple(v.global_shape), dtype_name(v.local.dtype)) for v in value}
        if len(kinds) > 1:
            raise StateMismatchError(f"{name}: its ShardedTensors disagree on the global shape "
                                     f"or dtype: {sorted(kinds)}")
        boxes = [v.box for v in value]
        for i, box in enumerate(boxes):
            for other in boxes[i + 1:]:
                if box.intersect(other) is not None:
                    raise StateMismatchError(f"{name}: ShardedTensors at {box} and {other} "
                                             "overlap; give each element once")
        shape, dtype = kinds.pop()
        return shape, dtype, [(v.box, v.local) for v in value]
    if isinstance(value, (ms.Tensor, np.ndarray)):
        shape = tuple(value.shape)
        dtype = dtype_name(value.dtype) if isinstance(value, ms.Tensor) else str(value.dtype)
        return shape, dtype, [(Box.whole(shape), value)]
    raise InvalidArgumentError(f"state dict value of {name!r} is a {type(value).__name__}; "
                               "expected a mindspore Tensor, a numpy array, a ShardedTensor or a "
                               "list of ShardedTensors")


def _load(entries: list[StateEntry], state_dict: Mapping, what: str) -> None:
    """Check everything first, then assign: a refused dict leaves every tensor as it was."""
    _check_keys(entries, state_dict, what)
    planned = []
    for entry in entries:
        shape, dtype, pieces = _pieces(entry.name, state_dict[entry.name])
        if shape != entry.global_shape or dtype != entry.dtype:
            raise StateMismatchError(
                f"{what}: {entry.name!r} is {dtype} of shape {shape}; the model's is "
                f"{entry.dtype} of shape {entry.global_shape}")
        planned.append((entry, pieces, plan_reads(entry.name, shape, entry.box,
                                                  [box for box, _ in pieces])))
    for entry, pieces, reads in planned:
        def read_part(index: int, part: Box, pieces=pieces) -> np.ndarray:
            box, source = pieces[index]
            if isinstance(source, np.ndarray):     # the caller's: assign() keeps what it gets
                return np.array(source[part.slices(box)])
            return np.asarray(to_numpy(source)[part.slices(box)])   # a copy of ours already
        entry.assign(assemble(entry.box, reads, read_part, host_dtype(entry.tensor.dtype)))


def get_model_state_dict(model, *, full_state_dict: bool = False) -> dict:
    """``{name: tensor}`` of ``model``'s parameters (see the module docstring for the forms)."""
    if not isinstance(full_state_dict, bool):
        raise InvalidArgumentError(f"full_state_dict must be a bool, got {full_state_dict!r}")
    return _state_dict(model_entries(model), full_state_dict)


def set_model_state_dict(model, state_dict: Mapping) -> None:
    """Load a full or sharded model state dict into ``model`` (every rank calls it)."""
    _load(model_entries(model), state_dict, "model state dict")


def get_optimizer_state_dict(model, optimizer, *, full_state_dict: bool = False) -> dict:
    """``{name: tensor}`` of ``optimizer``'s states (moments sharded like their parameter,
    step counters and powers whole)."""
    if not isinstance(full_state_dict, bool):
        raise InvalidArgumentError(f"full_state_dict must be a bool, got {full_state_dict!r}")
    return _state_dict(optimizer_entries(model, optimizer), full_state_dict)


def set_optimizer_state_dict(model, optimizer, state_dict: Mapping) -> None:
    """Load a full or sharded optimizer state dict (every rank calls it)."""
    _load(optimizer_entries(model, optimizer), state_dict, "optimizer state dict")
