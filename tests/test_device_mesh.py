"""DeviceMesh as mindformers' ParallelDims uses it: the rank arithmetic (property-tested against
NumPy for every rank of random meshes), ``_unflatten`` / ``_flatten`` / multi-name indexing and
``"fake"`` dims, and at world size 1 mindformers' own ``ParallelDims.build_mesh``. At 2 and 4
msrun ranks (groups, HSDP, EP, a collective per group): tests/test_mesh_meta_distributed.py."""
import importlib.util
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradpool import InvalidArgumentError, MeshGroupError
from hyper_parallel import DeviceMesh
from hyper_parallel.core import device_mesh as device_mesh_module
from hyper_parallel.core import mesh_layout

from installed import mindformers_installed


HAS_MINDFORMERS = mindformers_installed()


def grid_of(shape, ranks):
    return np.array(ranks).reshape(shape)


def numpy_group(shape, ranks, dims, rank):
    """The sub-mesh through ``rank`` keeping ``dims`` (in that order), by NumPy indexing."""
    grid = grid_of(shape, ranks)
    mine = tuple(int(c) for c in np.argwhere(grid == rank)[0])
    index = tuple(slice(None) if d in dims else mine[d] for d in range(len(shape)))
    kept = sorted(dims)
    sub = grid[index]                          # kept dims, in mesh order
    return tuple(np.transpose(sub, [kept.index(d) for d in dims]).reshape(-1).tolist())


@st.composite
def meshes(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=4)))
    ranks = draw(st.permutations(range(math.prod(shape))))
    return shape, tuple(ranks)


@settings(max_examples=150, deadline=None)
@given(meshes(), st.data())
def test_coordinates_groups_and_sub_meshes_match_numpy(mesh, data):
    shape, ranks = mesh
    rank = data.draw(st.sampled_from(ranks))
    coords = mesh_layout.coordinates(shape, ranks, rank)
    assert coords == tuple(int(c) for c in np.argwhere(grid_of(shape, ranks) == rank)[0])
    assert mesh_layout.rank_at(shape, ranks, coords) == rank
    for dim in range(len(shape)):
        assert mesh_layout.group_ranks(shape, ranks, dim, rank) == \
            numpy_group(shape, ranks, (dim,), rank)
    dims = tuple(data.draw(st.permutations(range(len(shape))))[
        :data.draw(st.integers(1, len(shape)))])
    assert mesh_layout.submesh_ranks(shape, ranks, dims, rank) == \
        numpy_group(shape, ranks, dims, rank)


@settings(max_examples=100, deadline=None)
@given(meshes(), st.data())
def test_unflatten_splits_a_dim_row_major(mesh, data):
    shape, ranks = mesh
    dim = data.draw(st.integers(0, len(shape) - 1))
    factors = _factorisations(shape[dim])
    sizes = data.draw(st.sampled_from(factors))
    new_shape = mesh_layout.unflatten_shape(shape, dim, sizes)
    # NumPy: reshaping the rank grid is the same split
    np.testing.assert_array_equal(grid_of(new_shape, ranks),
                                  grid_of(shape, ranks).reshape(new_shape))


def _factorisations(n):
    out = [(n,)]
    for a in range(2, n + 1):
        if n % a == 0 and a < n:
            out.append((a, n // a))
    return out


def test_unflatten_refuses_sizes_that_do_not_multiply_to_the_dim():
    with pytest.raises(ValueError, match=r"multiply to 6, not to the size 4"):
        mesh_layout.unflatten_shape((4,), 0, (2, 3))


# -- DeviceMesh, seen from each rank of an 8-rank job -------------------------------------------
@pytest.fixture
def as_rank(monkeypatch):
    """Make DeviceMesh see the job from world rank ``r`` (rank arithmetic only: no group)."""
    def use(rank):
        monkeypatch.setattr(DeviceMesh, "get_rank", lambda self: rank)
    return use


def test_unflatten_index_and_flatten_as_parallel_dims_calls_them(as_rank):
    world = DeviceMesh("npu", (8,), ("world",))
    for rank in range(8):
        as_rank(rank)
        dense = world._unflatten(0, (1, 2, 4, 1), ("pp", "dp_replicate", "fsdp", "tp"),
                                 backend_override={"pp": "fake", "tp": "fake"})
        assert dense.mesh_shape == (1, 2, 4, 1)
        assert dense.mesh_dim_names == ("pp", "dp_replicate", "fsdp", "tp")
        assert dense.backends == ("fake", None, None, "fake")
        hsdp = dense["dp_replicate", "fsdp"]
        assert hsdp.mesh_shape == (2, 4) and hsdp.backends == (None, None)
        assert hsdp.ranks == tuple(range(8))
        assert hsdp.get_local_rank("dp_replicate") == rank // 4
        assert hsdp.get_local_rank("fsdp") == rank % 4
        assert dense["fsdp"].ranks == numpy_group((1, 2, 4, 1), range(8), (2,), rank)
        assert dense["dp_replicate"].group_ranks() == numpy_group((2, 4), range(8), (0,), rank)
        assert dense["fsdp", "dp_replicate"].ranks == \
            numpy_group((1, 2, 4, 1), range(8), (2, 1), rank)
        flat = hsdp._flatten("dp")
        assert (flat.mesh_shape, flat.mesh_dim_names, flat.ranks) == ((8,), ("dp",), hsdp.ranks)
        assert dense["pp", "tp"]._flatten().mesh_dim_names == ("pp_tp",)
        assert dense["pp", "tp"]._flatten().backends == (None,)   # a flattened dim is real
        assert dense.size() == 8 and dense.size("fsdp") == 4 and dense.size(1) == 2


def test_unflatten_of_a_dim_in_the_middle_keeps_the_others(as_rank):
    as_rank(5)
    mesh = DeviceMesh("cpu", (2, 4), ("dp", "rest"))._unflatten(
        "rest", (2, 2), ("cp", "tp"), backend_override={1: "fake"})
    assert mesh.mesh_shape == (2, 2, 2)
    assert mesh.mesh_dim_names == ("dp", "cp", "tp")
    assert mesh.backends == (None, None, "fake")
    assert mesh["tp"].ranks == (4, 5) and mesh["cp"].ranks == (5, 7)


def test_a_fake_dim_has_no_group(as_rank, monkeypatch):
    created = []
    monkeypatch.setattr(device_mesh_module, "_group_for", lambda ranks: created.append(ranks))
    as_rank(1)
    mesh = DeviceMesh("npu", (4,), ("world",))._unflatten(
        0, (2, 2), ("efsdp", "ep"), backend_override={"efsdp": "fake"})
    with pytest.raises(MeshGroupError, match=r"'efsdp' \(2 ranks\).*'fake'"):
        mesh.get_group("efsdp")
    with pytest.raises(MeshGroupError, match="efsdp"):
        mesh["efsdp"].get_group()
    assert created == []
    mesh.get_group("ep")
    assert created == [(0, 1)]
    # a fake dim of one rank needs no group either: asking for it is not an error
    one = DeviceMesh("npu", (4,), ("world",))._unflatten(
        0, (1, 4), ("pp", "fsdp"), backend_override={"pp": "fake"})
    monkeypatch.setattr(device_mesh_module, "_group_for", lambda ranks: None)
    assert one.get_group("pp") is None


@pytest.mark.parametrize("call, message", [
    (lambda m: m._unflatten(0, (3, 2), ("a", "b")), "multiply to 6"),
    (lambda m: m._unflatten(0, (2, 2), ("a",)), "one name per size"),
    (lambda m: m._unflatten(0, (2, 2), ("a", "a")), "repeat"),
    (lambda m: m._unflatten(0, (2, 2), ("a", "b"), backend_override={"c": "fake"}),
     r"keys \['c'\] are not new dims"),
    (lambda m: m._unflatten(0, (2, 2), ("a", "b"), backend_override={"a": "nccl"}),
     "'nccl'.*not supported"),
    (lambda m: m._unflatten(0, (2, 2), ("a", "b"), backend_override={"a": "fake", 0: None}),
     "twice"),
    (lambda m: m["nope"], "no dim named 'nope'"),
    (lambda m: m[0], "by dim names"),
])
def test_mesh_reshaping_refuses_bad_arguments_by_name(as_rank, call, message):
    as_rank(0)
    with pytest.raises(InvalidArgumentError, match=message):
        call(DeviceMesh("npu", (4,), ("world",)))


def test_upstream_names_for_ranks_and_coordinates(as_rank):
    as_rank(6)
    mesh = DeviceMesh("npu", (2, 4), ("dp", "tp"))
    assert mesh.rank_list == tuple(range(8))
    assert mesh.get_coordinate() == (1, 2)
    assert mesh.get_rank_list_along_axis("tp") == (4, 5, 6, 7)


# -- mindformers' own ParallelDims at world size 1 -------------------------------------------
@pytest.mark.skipif(not HAS_MINDFORMERS, reason="mindformers is not installed (make mindformers)")
def test_parallel_dims_builds_its_meshes_at_world_size_1(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCAL_DEFAULT_PATH", str(tmp_path))      # mindformers' log directory
    import mindspore as ms
    from mindformers.pynative.distributed.parallel_dims import ParallelDims

    from hyper_parallel import fully_shard
    from mindspore import Parameter, mint, nn

    ms.set_device("CPU")
    dims = ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    world = dims.build_mesh()
    assert (world.mesh_shape, world.mesh_dim_names) == ((1,), ("world",))
    fsdp = dims.get_mesh("fsdp")
    assert (fsdp.mesh_shape, fsdp.mesh_dim_names, fsdp.ranks) == ((1,), ("fsdp",), (0,))
    assert dims.get_optional_mesh("dp_replicate") is None       # degree 1: a fake dim
    assert dims.get_optional_mesh("efsdp") is None              # ep 1
    assert dims.get_mesh("loss").mesh_dim_names == ("loss_mesh",)
    assert fsdp.get_group() is None and fsdp.get_local_rank() == 0 and fsdp.size() == 1
    assert dims.get_all_one_dimensional_meshes() == {}

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = Parameter(mint.ones((3, 2)), name="weight")

        def construct(self, x):
            return mint.matmul(x, self.weight.T)

    net = fully_shard(Net(), mesh=fsdp)     # apply_fsdp's 1-D mesh
    out = net(ms.Tensor(np.ones((1, 2), np.float32)))
    np.testing.assert_array_equal(out.asnumpy(), [[2.0, 2.0, 2.0]])
