"""Device meshes over the ranks of the job: N-D, row-major, with named dims and sub-meshes.

    mesh = init_device_mesh("npu", (2, 4), mesh_dim_names=("dp_replicate", "fsdp"))
    mesh["fsdp"]            # this rank's 1-D sub-mesh along "fsdp" (4 ranks)
    mesh.get_group("fsdp")  # the communication group of those ranks (created once)

A mesh is an array of world ranks (row-major over ``mesh_shape``, like upstream and torch).
Slicing keeps the named dims and fixes every other dim at this rank's coordinate, so a sub-mesh
covers part of the world: each group reduces only among its members. Groups are created with
MindSpore's ``create_group`` by their members only (what MindSpore requires), the first time a
rank asks for them; a group of one rank needs none, a group of every rank is the world group.

What mindformers' ``ParallelDims`` (a port of torchtitan's) builds its meshes with, as torch's
``DeviceMesh`` has them:

    world = init_device_mesh("npu", (8,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (1, 2, 4, 1), ("pp", "dp_replicate", "fsdp", "tp"),
                             backend_override={"pp": "fake", "tp": "fake"})
    dense["dp_replicate", "fsdp"]            # the 2-D HSDP mesh of this rank
    dense["dp_replicate", "fsdp"]._flatten("dp")   # the same ranks as one dim

A dim made with backend ``"fake"`` never gets a communicator (asking for its group is an error
when it has more than one rank); the rank arithmetic is :mod:`hyper_parallel.core.mesh_layout`.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

from gradpool import InvalidArgumentError, MeshGroupError, check_int
from hyper_parallel.core import mesh_layout

DEVICE_TYPES = ("npu", "cpu", "Ascend", "CPU")
FAKE_BACKEND = "fake"      # a dim that never communicates (torch's name for it)
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
                 ranks: Optional[Sequence[int]] = None, *,
                 backends: Optional[Sequence[Optional[str]]] = None):
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
        # per dim: None (a real group, made on first use) or "fake" (never a communicator)
        self.backends = _check_backends(backends, len(shape))

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
        return isinstance(other, DeviceMesh) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        return self.mesh_shape, self.mesh_dim_names, self.ranks, self.backends

    @property
    def rank_list(self) -> tuple[int, ...]:
        """The world ranks of the mesh, flat and row-major (upstream's name)."""
        return self.ranks

    # -- this rank --------------------------------------------------------------------------------
    def get_rank(self) -> int:
        from gradpool import init_distributed
        return init_distributed()[0]

    def coordinates(self, rank: Optional[int] = None) -> tuple[int, ...]:
        """Where world rank ``rank`` (default: this one) sits in the mesh."""
        rank = self.get_rank() if rank is None else rank
        if rank not in self.ranks:
            raise InvalidArgumentError(f"rank {rank} is not in {self!r}")
        return mesh_layout.coordinates(self.mesh_shape, self.ranks, rank)

    def get_coordinate(self) -> tuple[int, ...]:
        """This rank's coordinates (upstream's name)."""
        return self.coordinates()

    def get_local_rank(self, dim: Optional[Union[int, str]] = None) -> int:
        return self.coordinates()[self._dim(dim)]

    def group_ranks(self, dim: Optional[Union[int, str]] = None) -> tuple[int, ...]:
        """The world ranks of this rank's group along ``dim``, in mesh order."""
        index = self._dim(dim)
        self.coordinates()      # this rank must be in the mesh
        return mesh_layout.group_ranks(self.mesh_shape, self.ranks, index, self.get_rank())

    get_rank_list_along_axis = group_ranks      # upstream's name

    def get_group(self, dim: Optional[Union[int, str]] = None) -> Optional[str]:
        """The MindSpore communication group of :meth:`group_ranks` (created on first use);
        None for a group of one rank. The world group when it spans the whole job. A dim made
        with backend ``"fake"`` has none: asking for it (with more than one rank) raises."""
        ranks = self.group_ranks(dim)
        index = self._dim(dim)
        if self.backends[index] == FAKE_BACKEND and len(ranks) > 1:
            name = self.mesh_dim_names[index] if self.mesh_dim_names else index
            raise MeshGroupError(
                f"mesh dim {name!r} ({len(ranks)} ranks) was made with backend_override "
                f"{FAKE_BACKEND!r}: it has no communication group; make it without the override "
                "to communicate over it")
        return _group_for(ranks)

    # -- slicing ----------------------------------------------------------------------------------
    def __getitem__(self, names: Union[str, Sequence[str]]) -> "DeviceMesh":
        keep = (names,) if isinstance(names, str) else \
            tuple(names) if isinstance(names, (tuple, list)) else (names,)
        if not keep or not all(isinstance(name, str) for name in keep):
            raise InvalidArgumentError(
                f"index a mesh by dim names (a name or several), got {names!r}")
        dims = [self._dim(name) for name in keep]
        if len(set(dims)) != len(dims):
            raise InvalidArgumentError(f"mesh dims repeat in {keep}; name each dim once")
        self.coordinates()      # this rank must be in the mesh
        ranks = mesh_layout.submesh_ranks(self.mesh_shape, self.ranks, dims, self.get_rank())
        return DeviceMesh(self.device_type, tuple(self.mesh_shape[d] for d in dims), keep, ranks,
                          backends=tuple(self.backends[d] for d in dims))

    # -- reshaping (torch's private names, which torchtitan and mindformers call) -----------------
    def _unflatten(self, dim: Union[int, str], mesh_sizes: Sequence[int],
                   mesh_dim_names: Sequence[str],
                   backend_override: Optional[dict] = None) -> "DeviceMesh":
        """This mesh with ``dim`` split into dims of ``mesh_sizes`` named ``mesh_dim_names``
        (row-major: the ranks keep their order). ``backend_override`` maps a new dim (its name,
        or its index among the new dims) to ``"fake"`` (no communicator, ever) or None."""
        index = self._dim(dim)
        sizes = tuple(mesh_sizes)
        for size in sizes:
            check_int(f"_unflatten mesh_sizes {sizes} entry", size, 1)
        new_names = tuple(mesh_dim_names)
        if len(new_names) != len(sizes):
            raise InvalidArgumentError(
                f"_unflatten got {len(sizes)} sizes {sizes} but {len(new_names)} names "
                f"{new_names}; give one name per size")
        if math.prod(sizes) != self.mesh_shape[index]:
            raise InvalidArgumentError(
                f"_unflatten sizes {sizes} multiply to {math.prod(sizes)}, but dim {dim!r} has "
                f"{self.mesh_shape[index]} ranks")
        if self.mesh_dim_names is None and self.ndim > 1:
            raise InvalidArgumentError(
                "_unflatten needs a mesh with named dims (or a 1-D one): name the mesh's dims")
        names = (self.mesh_dim_names or (None,))
        names = names[:index] + new_names + names[index + 1:]
        backends = (self.backends[:index] + _override_backends(backend_override, new_names)
                    + self.backends[index + 1:])
        return DeviceMesh(self.device_type,
                          mesh_layout.unflatten_shape(self.mesh_shape, index, sizes),
                          names, self.ranks, backends=backends)

    def _flatten(self, mesh_dim_name: Optional[str] = None) -> "DeviceMesh":
        """The same ranks as a 1-D mesh (row-major) named ``mesh_dim_name`` (default: the dim
        names joined by ``_``), whose one dim is a real group whatever its dims were."""
        if mesh_dim_name is None:
            if self.mesh_dim_names is None:
                raise InvalidArgumentError("_flatten of a mesh without dim names needs a name")
            mesh_dim_name = "_".join(self.mesh_dim_names)
        return DeviceMesh(self.device_type, (self.size(),), (mesh_dim_name,), self.ranks)

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



def _check_backends(backends, ndim: int) -> tuple[Optional[str], ...]:
    if backends is None:
        return (None,) * ndim
    backends = tuple(backends)
    if len(backends) != ndim or any(b not in (None, FAKE_BACKEND) for b in backends):
        raise InvalidArgumentError(
            f"backends must give each of the {ndim} dims None or {FAKE_BACKEND!r}, got {backends}")
    return backends


def _override_backends(override: Optional[dict], names: tuple) -> tuple[Optional[str], ...]:
    """Per new dim, its backend from ``backend_override`` (keys: names or indices of the new
    dims; values: None, ``"fake"``)."""
    override = dict(override or {})
    backends = []
    for position, name in enumerate(names):
        if name in override and position in override:
            raise InvalidArgumentError(
                f"backend_override names dim {name!r} twice (by name and as {position})")
        value = override.pop(name, override.pop(position, None))
        if value not in (None, FAKE_BACKEND):
            raise InvalidArgumentError(
                f"backend_override {value!r} for dim {name!r} is not supported: gradpool makes "
                f"MindSpore's own groups; give None or {FAKE_BACKEND!r} (no communicator)")
        backends.append(value)
    if override:
        raise InvalidArgumentError(
            f"backend_override keys {list(override)} are not new dims: use names of {names} or "
            f"indices 0..{len(names) - 1}")
    return tuple(backends)


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
