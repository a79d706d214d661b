"""Device meshes over the ranks of the job: N-D, row-major, with named dims and sub-meshes.

    mesh = init_device_mesh("npu", (2, 4), mesh_dim_names=("dp_replicate", "fsdp"))
    mesh["fsdp"]            # this rank's 1-D sub-mesh along "fsdp" (4 ranks)
    mesh.get_group("fsdp")  # the communication group of those ranks (created once)

A mesh is an array of world ranks (row-major over ``mesh_shape``, like upstream and torch).
Slicing keeps the named dims and fixes every other dim at this rank's coordinate, so a sub-mesh
covers part of the world: each group reduces only among its members. Groups are created with
MindSpore's ``create_group`` by their members only (what MindSpore requires), the first time a
rank asks for them; a group of one rank needs none, a group of every rank is the world group.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

from gradpool import InvalidArgumentError, check_int

DEVICE_TYPES = ("npu", "cpu", "Ascend", "CPU")
_GROUPS: dict[tuple[int, ...], Optional[str]] = {}   # ranks -> group name (None: world or one)


def _check_names(names, ndim: int) -> Optional[tuple[str, ...]]:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim:
        raise InvalidArgumentError(
            f"mesh_dim_names {names} has {len(names)} names for a {ndim}-D mesh_shape")
    if not all(isinstance(n, str) and n for n in names):
        raise InvalidArgumentError(f"mesh_dim_names must be non-empty strings, got {names}")
    if len(set(names)) != len(names):
        raise InvalidArgumentError(f"mesh_dim_names repeat a name: {names}; name each dim once")
    return names


class DeviceMesh:
    """``mesh_shape`` ranks laid out row-major; ``ranks`` (flat, row-major) are the world ranks
    of its positions (default: ``0 .. size-1``, the whole job)."""

    def __init__(self, device_type: str, mesh_shape: Sequence[int],
                 mesh_dim_names: Optional[Sequence[str]] = None,
                 ranks: Optional[Sequence[int]] = None):
        if device_type not in DEVICE_TYPES:
            raise InvalidArgumentError(
                f"device_type {device_type!r} is not supported; use one of {DEVICE_TYPES}")
        shape = tuple(mesh_shape)
        if not shape:
            raise InvalidArgumentError("mesh_shape must have at least one dim, got ()")
        for size in shape:
            check_int(f"mesh_shape {shape} entry", size, 1)
        self.device_type = device_type
        self.mesh_shape = shape
        self.mesh_dim_names = _check_names(mesh_dim_names, len(shape))
        ranks = tuple(range(math.prod(shape))) if ranks is None else tuple(ranks)
        for rank in ranks:
            check_int("mesh rank", rank, 0)
        if len(ranks) != math.prod(shape) or len(set(ranks)) != len(ranks):
            raise InvalidArgumentError(
                f"a {shape} mesh needs {math.prod(shape)} distinct ranks, got {ranks}")
        self.ranks = ranks

    # -- shape ------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    def size(self, dim: Optional[Union[int, str]] = None) -> int:
        return math.prod(self.mesh_shape) if dim is None else self.mesh_shape[self._dim(dim)]

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.mesh_shape}{names}, ranks={self.ranks})"

    def __eq__(self, other) -> bool:
        return isinstance(other, DeviceMesh) and (self.mesh_shape, self.mesh_dim_names,
                                                  self.ranks) == (other.mesh_shape,
                                                                  other.mesh_dim_names,
                                                                  other.ranks)

    def __hash__(self) -> int:
        return hash((self.mesh_shape, self.mesh_dim_names, self.ranks))

    # -- this rank --------------------------------------------------------------------------------
    def get_rank(self) -> int:
        from gradpool import init_distributed
        return init_distributed()[0]

    def coordinates(self, rank: Optional[int] = None) -> tuple[int, ...]:
        """Where world rank ``rank`` (default: this one) sits in the mesh."""
        rank = self.get_rank() if rank is None else rank
        if rank not in self.ranks:
            raise InvalidArgumentError(f"rank {rank} is not in {self!r}")
        flat = self.ranks.index(rank)
        coords = []
        for size in reversed(self.mesh_shape):
            flat, coord = divmod(flat, size)
            coords.append(coord)
        return tuple(reversed(coords))

    def get_local_rank(self, dim: Optional[Union[int, str]] = None) -> int:
        return self.coordinates()[self._dim(dim)]

    def group_ranks(self, dim: Optional[Union[int, str]] = None) -> tuple[int, ...]:
        """The world ranks of this rank's group along ``dim``, in mesh order."""
        index = self._dim(dim)
        mine = self.coordinates()
        return tuple(self._rank_at(mine[:index] + (i,) + mine[index + 1:])
                     for i in range(self.mesh_shape[index]))

    def get_group(self, dim: Optional[Union[int, str]] = None) -> Optional[str]:
        """The MindSpore communication group of :meth:`group_ranks` (created on first use);
        None for a group of one rank. The world group when it spans the whole job."""
        return _group_for(self.group_ranks(dim))

    # -- slicing ----------------------------------------------------------------------------------
    def __getitem__(self, names: Union[str, Sequence[str]]) -> "DeviceMesh":
        keep = (names,) if isinstance(names, str) else tuple(names)
        dims = [self._dim(name) for name in keep]
        if len(set(dims)) != len(dims):
            raise InvalidArgumentError(f"mesh dims repeat in {keep}; name each dim once")
        mine = self.coordinates()
        shape = tuple(self.mesh_shape[d] for d in dims)
        ranks = []
        for flat in range(math.prod(shape)):
            coords, rest = list(mine), flat
            for d, size in zip(reversed(dims), reversed(shape)):
                rest, coords[d] = divmod(rest, size)
            ranks.append(self._rank_at(tuple(coords)))
        return DeviceMesh(self.device_type, shape, keep, ranks)

    # -- internals --------------------------------------------------------------------------------
    def _dim(self, dim: Optional[Union[int, str]]) -> int:
        if dim is None:
            if self.ndim != 1:
                raise InvalidArgumentError(f"a {self.ndim}-D mesh needs a dim (index or name)")
            return 0
        if isinstance(dim, str):
            if not self.mesh_dim_names or dim not in self.mesh_dim_names:
                raise InvalidArgumentError(
                    f"mesh has no dim named {dim!r}; its dims are {self.mesh_dim_names}")
            return self.mesh_dim_names.index(dim)
        check_int("mesh dim", dim, 0, self.ndim - 1)
        return dim

    def _rank_at(self, coords: tuple[int, ...]) -> int:
        flat = 0
        for coord, size in zip(coords, self.mesh_shape):
            flat = flat * size + coord
        return self.ranks[flat]


def _group_for(ranks: tuple[int, ...]) -> Optional[str]:
    from gradpool import init_distributed
    if ranks in _GROUPS:
        return _GROUPS[ranks]
    _, world = init_distributed()
    if len(ranks) == 1:
        name = None
    elif sorted(ranks) == list(range(world)) and list(ranks) == sorted(ranks):
        from mindspore.communication import GlobalComm
        name = GlobalComm.WORLD_COMM_GROUP
    else:
        from mindspore.communication import create_group
        name = "gradpool_mesh_" + "_".join(map(str, ranks))
        create_group(name, list(ranks))
    _GROUPS[ranks] = name
    return name


def init_device_mesh(device_type: str, mesh_shape: Sequence[int], *,
                     mesh_dim_names: Optional[Sequence[str]] = None) -> DeviceMesh:
    """A mesh over every rank of the job, row-major; its size must be the world size."""
    from gradpool import init_distributed

    mesh = DeviceMesh(device_type, mesh_shape, mesh_dim_names)
    _, world = init_distributed()
    if mesh.size() != world:
        raise InvalidArgumentError(
            f"mesh_shape {mesh.mesh_shape} covers {mesh.size()} ranks but the job has {world}; "
            "the mesh must cover every rank")
    return mesh
