"""The layout of a managed parameter (pure Python): placements, padded local shapes, the real
part each rank holds, and how many ranks hold each element."""
import numpy as np
import pytest

from gradpool import InvalidArgumentError
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Partial, Replicate, Shard
from hyper_parallel.core.dtensor.spec import DTensorSpec, fully_shard_spec, spec_from_local


@pytest.mark.parametrize("shape,ranks", [((5, 3), 2), ((7,), 4), ((3, 2), 4), ((8, 1), 2)])
def test_local_boxes_tile_the_tensor_once(shape, ranks):
    """Every element is held by exactly one shard (the last ranks' chunks may be short or empty),
    and every local shard has the padded chunk's shape."""
    spec = fully_shard_spec(DeviceMesh("cpu", (ranks,)), shape, 0, replicate=False)
    owners = np.zeros(shape, int)
    for rank in range(ranks):
        box = spec.local_box((rank,))
        owners[box.slices()] += 1
        assert box.lengths[0] <= spec.local_shape[0] == -(-shape[0] // ranks)
    assert (owners == 1).all()


def test_hsdp_layout_and_replica_counts():
    mesh = DeviceMesh("cpu", (2, 2), ("dp_replicate", "fsdp"))
    sharded = fully_shard_spec(mesh, (5, 3), 1, replicate=False)
    assert sharded.placements == (Replicate(), Shard(1))
    assert sharded.local_shape == (5, 2) and sharded.replica_count() == 2
    assert sharded.local_box((1, 1)).offsets == (0, 2) and sharded.local_box((1, 1)).lengths == (5, 1)
    whole = fully_shard_spec(mesh, (3,), 0, replicate=True)
    assert whole.placements == (Replicate(), Replicate()) and whole.replica_count() == 4
    assert fully_shard_spec(DeviceMesh("cpu", (4,)), (9,), 0, False).replica_count() == 1


def test_from_local_multiplies_sharded_dims():
    mesh = DeviceMesh("cpu", (2, 3))
    spec = spec_from_local(mesh, (Shard(1), Partial()), (4, 5))
    assert spec.global_shape == (4, 10) and spec.local_shape == (4, 5)


@pytest.mark.parametrize("placements,shape", [((Shard(0),), (4,)),             # 1 for a 2-D mesh
                                              ((Shard(2), Replicate()), (4, 4)),  # no dim 2
                                              ((Shard(0), Shard(0)), (4, 4))])    # dim 0 twice
def test_bad_specs_are_refused(placements, shape):
    with pytest.raises(InvalidArgumentError):
        DTensorSpec(DeviceMesh("cpu", (2, 2)), placements, shape)


def test_partial_names_its_reduce_op():
    assert Partial().reduce_op == "sum" and Partial().is_partial()
    with pytest.raises(InvalidArgumentError, match="product"):
        Partial("product")


def test_a_dtensor_layout_is_its_spec_and_tensor_parallel_queries_are_refused():
    """mindformers' _apply_spmd_parallelism logs ``param.layout`` of every DTensor parameter;
    its tensor-parallel helpers ask the layout for split ids: refused by name."""
    from gradpool import FeatureNotProvidedError
    from hyper_parallel.core.dtensor.dtensor import DTensor
    import mindspore as ms
    mesh = DeviceMesh("cpu", (2,))
    tensor = DTensor.from_local(ms.Tensor(np.zeros((3, 4), np.float32)), mesh, (Shard(0),))
    assert tensor.layout == DTensorSpec(mesh, (Shard(0),), (6, 4))
    with pytest.raises(FeatureNotProvidedError, match="layout.get_split_id"):
        tensor.layout.get_split_id(0)
