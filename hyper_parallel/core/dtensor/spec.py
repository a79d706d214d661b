"""Where a distributed tensor's pieces are: a mesh, one placement per mesh dim, the global shape
(pure Python, no MindSpore).

Sharding follows the pool's geometry (``gradpool.layout.GradSlot``): along a sharded dim every
rank holds ``ceil(n / ranks)`` rows, the last ones zero-padded (or wholly padding), so a local
shard is the padded chunk and its real part is :meth:`DTensorSpec.local_box`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from gradpool import InvalidArgumentError
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.boxes import Box
from hyper_parallel.core.dtensor.placement_types import Placement, Replicate, Shard


@dataclass(frozen=True)
class DTensorSpec:
    """``placements[i]`` says how the tensor lies along mesh dim ``i``."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    global_shape: tuple[int, ...]

    def __getattr__(self, name: str):
        # Only reached for what a spec lacks: upstream Layout's tensor-parallel queries
        # (get_split_id, tensor_map, ...) are refused by name, never an AttributeError; dunders
        # probed by Python's own machinery (copy, pickle) stay AttributeErrors.
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        from hyper_parallel.core.not_provided import DTENSOR_LAYOUTS, refuse
        refuse(f"layout.{name}", DTENSOR_LAYOUTS)

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise InvalidArgumentError(f"a DTensor needs a DeviceMesh, got {self.mesh!r}")
        if len(self.placements) != self.mesh.ndim:
            raise InvalidArgumentError(
                f"placements {self.placements} name {len(self.placements)} mesh dims but the "
                f"mesh {self.mesh.mesh_shape} has {self.mesh.ndim}; give one per mesh dim")
        sharded = [p.dim for p in self.placements if isinstance(p, Shard)]
        for placement in self.placements:
            if not isinstance(placement, Placement):
                raise InvalidArgumentError(f"{placement!r} is not a Placement")
        for dim in sharded:
            if not 0 <= dim < len(self.global_shape):
                raise InvalidArgumentError(
                    f"Shard({dim}) of a tensor of shape {self.global_shape}: no such dim")
        if len(set(sharded)) != len(sharded):
            raise InvalidArgumentError(
                f"placements {self.placements} shard one tensor dim over two mesh dims; "
                "not supported")

    def chunk_length(self, mesh_dim: int) -> int:
        """Rows per rank along the tensor dim ``placements[mesh_dim]`` shards."""
        dim = self.placements[mesh_dim].dim
        return math.ceil(self.global_shape[dim] / self.mesh.mesh_shape[mesh_dim])

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape every rank's local shard has (padded to equal chunks)."""
        shape = list(self.global_shape)
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                shape[placement.dim] = self.chunk_length(mesh_dim)
        return tuple(shape)

    def local_box(self, coordinates: Sequence[int]) -> Box:
        """The real (unpadded) part of the global tensor that the rank at mesh ``coordinates``
        holds."""
        offsets = [0] * len(self.global_shape)
        lengths = list(self.global_shape)
        for mesh_dim, placement in enumerate(self.placements):
            if isinstance(placement, Shard):
                chunk = self.chunk_length(mesh_dim)
                start = min(coordinates[mesh_dim] * chunk, self.global_shape[placement.dim])
                offsets[placement.dim] = start
                lengths[placement.dim] = min(chunk, self.global_shape[placement.dim] - start)
        return Box(tuple(offsets), tuple(lengths))

    def replica_count(self) -> int:
        """How many ranks hold each element: the product of the Replicate mesh dims' sizes."""
        return math.prod(size for size, p in zip(self.mesh.mesh_shape, self.placements)
                         if isinstance(p, Replicate))


def fully_shard_spec(mesh: DeviceMesh, global_shape: Sequence[int], shard_dim: int,
                     replicate: bool) -> DTensorSpec:
    """The layout of a parameter ``fully_shard`` manages over ``mesh`` (1-D: shard; 2-D:
    replicate over dim 0, shard over dim 1): ``(Shard(d),)`` / ``(Replicate(), Shard(d))``, and
    ``Replicate()`` on every dim for a parameter it keeps whole."""
    if replicate:
        inner: Placement = Replicate()
    else:
        inner = Shard(shard_dim)
    outer = (Replicate(),) * (mesh.ndim - 1)
    return DTensorSpec(mesh, outer + (inner,), tuple(int(n) for n in global_shape))


def spec_from_local(mesh: DeviceMesh, placements: Sequence[Placement],
                    local_shape: Sequence[int]) -> DTensorSpec:
    """The spec of a tensor given by its local part (``DTensor.from_local``): every rank's
    part has this shape, so a sharded dim is ``local * ranks`` long."""
    shape = list(local_shape)
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Shard):
            if not 0 <= placement.dim < len(shape):
                raise InvalidArgumentError(
                    f"Shard({placement.dim}) of a local tensor of shape {tuple(local_shape)}")
            shape[placement.dim] *= mesh.mesh_shape[mesh_dim]
    return DTensorSpec(mesh, tuple(placements), tuple(shape))
