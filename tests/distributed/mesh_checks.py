"""Checks of the meshes mindformers' own ``ParallelDims`` builds on this rank, shared by the 2-
and 4-rank launches (tests/distributed/meshmeta_cases*.py).

For one parallel configuration, on every rank: each mesh ParallelDims hands out (the 1-D ones
it enables, the HSDP ``[dp_replicate, fsdp]`` mesh and the expert ``[dp_replicate,] efsdp``
mesh ``apply_fsdp`` asks for) has the ranks NumPy finds in the row-major grid of its named dims;
each of its dims' groups is the right group (a group of one rank is None), and an all-reduce of
``rank + 1`` over it, through MindSpore's own ``mint.distributed.all_reduce`` as mindformers
calls it, gives the sum over those ranks.
"""
from __future__ import annotations

import os

import mindspore as ms
import numpy as np

from harness import Context, equal

# The order torchtitan / mindformers unflatten the world in (ParallelDims.build_mesh).
DENSE = ("pp", "dp_replicate", "fsdp", "tp")
SPARSE = ("pp", "dp_replicate", "efsdp", "ep")


def parallel_dims(config: dict, world: int, log_dir: str):
    os.environ.setdefault("LOCAL_DEFAULT_PATH", log_dir)     # mindformers' log directory
    from mindformers.pynative.distributed.parallel_dims import ParallelDims
    dims = ParallelDims(cp=1, tp=1, pp=1, world_size=world, **config)
    dims.build_mesh()
    return dims


def expected_group(rank: int, world: int, names: tuple, sizes: tuple, keep: tuple) -> list:
    """The world ranks of the sub-mesh through ``rank`` keeping dims ``keep``, from the
    row-major grid ``np.arange(world).reshape(sizes)``."""
    grid = np.arange(world).reshape(sizes)
    mine = [int(c) for c in np.argwhere(grid == rank)[0]]
    index = tuple(slice(None) if n in keep else mine[i] for i, n in enumerate(names))
    return grid[index].reshape(-1).tolist()


def group_sum(mesh, dim) -> tuple:
    """(group name, the all-reduced rank+1 over the mesh's ``dim`` group) on this rank."""
    from mindspore.mint.distributed import all_reduce
    group = mesh.get_group(dim)
    value = ms.Tensor(np.array([mesh.get_rank() + 1.0], np.float32))
    if group is not None:
        all_reduce(value, group=group)
    return group, float(value.asnumpy()[0])


def check_config(ctx: Context, config: dict, log_dir: str) -> dict:
    """The meshes apply_fsdp and the Trainer take from ParallelDims, each against NumPy."""
    dims = parallel_dims(config, ctx.world_size, log_dir)
    rank, world = ctx.rank, ctx.world_size
    dense_sizes = (1, dims.dp_replicate, dims.dp_shard, 1)
    sparse_sizes = (1, dims.dp_replicate, dims.dp_shard // dims.ep, dims.ep)
    meshes = {"fsdp": (dims.get_mesh("fsdp"), DENSE, dense_sizes)}
    if dims.dp_replicate_enabled:
        meshes["dp_replicate"] = (dims.get_mesh("dp_replicate"), DENSE, dense_sizes)
        meshes["dp_replicate+fsdp"] = (dims.get_mesh(["dp_replicate", "fsdp"]), DENSE,
                                       dense_sizes)
    if dims.ep_enabled:
        meshes["ep"] = (dims.get_mesh("ep"), SPARSE, sparse_sizes)
        names = ["dp_replicate", "efsdp"] if dims.dp_replicate_enabled else ["efsdp"]
        meshes["+".join(names)] = (dims.get_mesh(names), SPARSE, sparse_sizes)
    checks = {}
    for label, (mesh, order, sizes) in meshes.items():
        keep = tuple(mesh.mesh_dim_names)
        checks[f"{label} ranks"] = equal(list(mesh.ranks),
                                         expected_group(rank, world, order, sizes, keep))
        for dim in keep:
            members = expected_group(rank, world, order, sizes, (dim,))
            checks[f"{label} {dim}"] = _group_checks(mesh, dim, rank, members)
    # the Trainer's metric group: batch x cp flattened, here every rank
    loss = dims.get_mesh("loss")
    checks["loss ranks"] = equal([list(loss.mesh_dim_names), list(loss.ranks)],
                                 [["loss_mesh"], list(range(world))])
    checks["loss group"] = _group_checks(loss, None, rank, list(range(world)))
    return checks


def _group_checks(mesh, dim, rank: int, members: list) -> dict:
    group, total = group_sum(mesh, dim)
    return equal([mesh.get_local_rank(dim), mesh.size(dim), group is None, total],
                 [members.index(rank), len(members), len(members) == 1,
                  float(sum(r + 1 for r in members))])


def check_dense_shard_mesh(ctx: Context, config: dict, shard_size: int, log_dir: str) -> dict:
    """``ParallelDims.get_fsdp_shard_mesh(k)`` (apply_fsdp's mesh when ``dense_fsdp_shard_size``
    is set): the world re-unflattened as (pp, replicate, k, tp), its 2-D [replicate, shard]."""
    dims = parallel_dims(config, ctx.world_size, log_dir)
    rank, world = ctx.rank, ctx.world_size
    mesh = dims.get_fsdp_shard_mesh(shard_size)
    replicate = dims.dp_replicate * dims.dp_shard // shard_size
    names = ("pp", f"fsdp_rep_{shard_size}", f"fsdp_shard_{shard_size}", "tp")
    sizes = (1, replicate, shard_size, 1)
    checks = {"ranks": equal([list(mesh.mesh_dim_names), list(mesh.ranks)],
                             [list(names[1:3]), expected_group(rank, world, names, sizes,
                                                               names[1:3])])}
    for dim in names[1:3]:
        checks[dim] = _group_checks(mesh, dim, rank, expected_group(rank, world, names, sizes,
                                                                    (dim,)))
    return checks
