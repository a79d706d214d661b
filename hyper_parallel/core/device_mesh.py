"""A 1-D device mesh over the ranks of the job (the shard group of ``fully_shard``)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from gradpool import InvalidArgumentError

DEVICE_TYPES = ("npu", "cpu", "Ascend", "CPU")


@dataclass(frozen=True)
class DeviceMesh:
    device_type: str
    mesh_shape: tuple[int, ...]
    mesh_dim_names: Optional[tuple[str, ...]] = None

    @property
    def ndim(self) -> int:
        return len(self.mesh_shape)

    def size(self, dim: Optional[int] = None) -> int:
        return math.prod(self.mesh_shape) if dim is None else self.mesh_shape[dim]


def init_device_mesh(device_type: str, mesh_shape: Sequence[int],
                     mesh_dim_names: Optional[Sequence[str]] = None) -> DeviceMesh:
    """Build a mesh over all ranks of the job; its size must equal the world size."""
    from gradpool import init_distributed

    if device_type not in DEVICE_TYPES:
        raise InvalidArgumentError(
            f"device_type {device_type!r} is not supported; use one of {DEVICE_TYPES}")
    shape = tuple(int(d) for d in mesh_shape)
    if not shape or any(d < 1 for d in shape):
        raise InvalidArgumentError(f"mesh_shape must be positive sizes, got {tuple(mesh_shape)}")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != len(shape):
        raise InvalidArgumentError(
            f"mesh_dim_names {names} has {len(names)} names for a {len(shape)}-D mesh_shape")
    _, world = init_distributed()
    if math.prod(shape) != world:
        raise InvalidArgumentError(
            f"mesh_shape {shape} covers {math.prod(shape)} ranks but the job has {world}; "
            "the mesh must cover every rank")
    return DeviceMesh(device_type, shape, names)
