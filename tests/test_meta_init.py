"""Meta-device initialisation in one process (world size 1), mindformers' Trainer order: build
under ``ms.DeviceCtx("meta")``, ``fully_shard`` inside it, ``to_empty()``, ``init_states()``.
Two ranks with uneven shards, and peak memory at four, are tests/test_mesh_meta_distributed.py.
"""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, mint, nn
from mindspore.graph.api import _no_grad

import meta_models
from gradpool import BucketPool, MetaDeviceError, device_target, real_device_target
from gradpool import runtime as runtime_module
from hyper_parallel import fully_shard
from hyper_parallel.platform.mindspore.fully_shard import meta_init

ms.set_device("CPU")
X = ms.Tensor(np.random.default_rng(2).standard_normal((3, 11)).astype(np.float32))


@pytest.fixture(autouse=True)
def fresh_runtimes():
    runtime_module.reset_runtimes()
    with meta_models.cpu_initialisers():
        yield
    runtime_module.reset_runtimes()


def loss_and_grads(net):
    params = net.trainable_params()
    loss, _ = ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, params)(X)
    return float(loss.asnumpy()), [np.array(p.main_grad.asnumpy()) for p in params]


# (normal_ marked continues_across_calls, block budget): the whole chunk in one block; 7
# elements a block, across rows of 11; the full draw MindSpore's own ops get
DRAWS = [(True, None), (True, 28), (False, None)]


@pytest.mark.parametrize("block_by_block, block_bytes", DRAWS)
def test_meta_init_gives_the_values_of_initialising_on_the_device_then_sharding(
        monkeypatch, caplog, block_by_block, block_bytes):
    if block_bytes is not None:
        monkeypatch.setattr(meta_init, "BLOCK_BYTES", block_bytes)
    monkeypatch.setattr(meta_init, "_FULL_DRAW_LOGGED", set())
    reference = meta_models.shard(meta_models.build_reference(seed=7))
    expected = meta_models.local_values(reference)
    next_after_reference = np.random.normal(size=5)     # the stream where the init left it
    draws = []
    with meta_models.cpu_initialisers(block_by_block, draws), caplog.at_level("INFO"):
        built = meta_models.build_meta(seed=7)
    next_after_built = np.random.normal(size=5)
    got = meta_models.local_values(built)
    assert list(got) == list(expected)
    for name, values in expected.items():
        np.testing.assert_array_equal(got[name], values, err_msg=name)
    np.testing.assert_array_equal(next_after_built, next_after_reference)
    # random draws really ran (not zeros), and every parameter is on the real device
    assert np.abs(got["embed.weight"]).max() > 0
    assert all(p.device == "CPU" for p in built.trainable_params())
    assert all(p.main_grad.device == "CPU" for p in built.trainable_params())
    if block_by_block and block_bytes is None:      # what the values give, once
        assert loss_and_grads(built)[0] == loss_and_grads(reference)[0]
    # the draws: in blocks of the budget, or the full parameters (6 x 11 first), logged once
    full_draw = "normal_ on a sharded parameter draws the full parameter"
    if block_bytes is not None:
        assert max(draws) == 7 and sum(draws) == 66 + 2 * (42 + 42) + 66
    else:
        assert draws == [66, 42, 42, 42, 42, 66]
    assert caplog.text.count(full_draw) == (0 if block_by_block else 1)


def test_fully_shard_under_meta_records_shards_without_memory():
    with ms.DeviceCtx("meta"):
        net = meta_models.shard(meta_models.Net())
    params = net.trainable_params()
    assert params and all(p.device == "meta" for p in params)
    assert {p.name: tuple(p.shape) for p in params}["embed.weight"] == (6, 11)
    # main_grad and the pool live on the real device whatever context fully_shard ran in
    assert all(p.main_grad.device == "CPU" for p in params)
    assert all(r.pool.device == "CPU" for r in runtime_module.all_runtimes())


def test_a_forward_refuses_parameters_still_on_meta_by_name():
    with ms.DeviceCtx("meta"):
        net = meta_models.shard(meta_models.Net())
    with pytest.raises(MetaDeviceError, match=r"embed\.weight, embed\.bias; call model\.to_empty\(\)"):
        net(X)
    net.to_empty()
    with _no_grad():
        net.init_states()
    loss, grads = loss_and_grads(net)          # the same model trains once materialised
    assert np.isfinite(loss) and any(np.abs(g).max() > 0 for g in grads)


def test_initialising_before_to_empty_is_refused_by_name():
    with ms.DeviceCtx("meta"):
        net = meta_models.shard(meta_models.Net())
    with pytest.raises(MetaDeviceError, match=r"head\.weight\.normal_\(\).*to_empty"):
        net.head.reset_parameter()


def test_real_parameters_sharded_inside_a_meta_context_stay_on_the_device():
    """apply_fsdp calls every fully_shard inside DeviceCtx('meta'), also for a model built on
    the device: the shards must not land on meta."""
    reference = meta_models.build_reference(seed=3)
    expected = {p.name: np.array(p.asnumpy()) for p in reference.trainable_params()}
    twin = meta_models.build_reference(seed=3)
    with ms.DeviceCtx("meta"):
        meta_models.shard(twin)
    assert all(p.device == "CPU" for p in twin.trainable_params())
    for p in twin.trainable_params():
        np.testing.assert_array_equal(p.asnumpy(), expected[p.name], err_msg=p.name)
    assert loss_and_grads(twin)[0] == pytest.approx(float(((reference(X)) ** 2).sum().asnumpy()))


def test_the_device_is_resolved_past_a_meta_context():
    with ms.DeviceCtx("meta"):
        assert device_target() == "meta"
        assert real_device_target() == "CPU"
        pool = BucketPool()
    assert pool.device == "CPU"
    # (a step run inside a meta context is not supported: MindSpore makes every op's output
    # there, even a view of a real tensor, a meta tensor)
    lease = pool.acquire(8, ms.float32)
    assert lease.tensor.device == "CPU"
    lease.release()


def test_to_empty_of_a_sharded_model_allocates_local_shards_on_the_device():
    with ms.DeviceCtx("meta"):
        net = meta_models.shard(meta_models.Net())
    net.to_empty()
    shapes = {p.name: (p.device, tuple(p.shape)) for p in net.trainable_params()}
    assert shapes["head.weight"] == ("CPU", (11, 6))
    plain = nn.Dense(2, 2)
    with ms.DeviceCtx("meta"):
        plain = nn.Dense(2, 2)
    plain.to_empty()       # MindSpore's own: a meta tensor stays on meta (why HSDPModule overrides)
    assert plain.weight.device == "meta"


def test_bfloat16_shards_initialise_like_the_unsharded_parameter():
    class Cell(nn.Cell):
        def __init__(self):
            super().__init__()
            self.inner = meta_models.Linear(4, 5, dtype=ms.bfloat16)

    np.random.seed(1)
    whole = Cell()
    whole.inner.reset_parameter()
    expected = np.array(whole.inner.weight.astype(ms.float32).asnumpy())
    with ms.DeviceCtx("meta"):
        net = Cell()
        fully_shard(net.inner, mp_policy=meta_models.MAIN_GRAD)
        fully_shard(net, mp_policy=meta_models.MAIN_GRAD)
    net.to_empty()
    np.random.seed(1)
    net.inner.reset_parameter()
    assert net.inner.weight.dtype == ms.bfloat16
    np.testing.assert_array_equal(net.inner.weight.astype(ms.float32).asnumpy(), expected)
    np.testing.assert_array_equal(net.inner.bias.astype(ms.float32).asnumpy(), np.zeros(5))


def test_a_managed_parameter_initialised_in_place_keeps_its_identity():
    net = meta_models.shard(meta_models.build_reference(seed=4))
    weight = net.head.weight
    optimizer_view = net.trainable_params()
    np.random.seed(9)
    assert net.head.weight.normal_(mean=0.0, std=0.01) is weight
    assert any(p is weight for p in optimizer_view)
    assert isinstance(weight, Parameter)
    np.random.seed(9)
    np.testing.assert_array_equal(weight.asnumpy(),
                                  np.random.normal(0.0, 0.01, (11, 6)).astype(np.float32))


def test_mint_is_untouched_by_the_stand_ins():
    # the stand-ins replace only the three in-place initialisers, inside the fixture
    assert mint.zeros((2,)).asnumpy().tolist() == [0.0, 0.0]
