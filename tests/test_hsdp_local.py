"""HSDP surface in one process: mesh logic, upstream's reduce controls (checked arguments and
their effect), a list as one unit, and clip_grad_norm_ against NumPy. The 4-rank behaviour is
tests/test_hsdp_distributed.py."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, mint, nn

from gradpool import (GradPoolConfig, InvalidArgumentError, NonFiniteNormError,
                      SingleProcessCommunicator)
from gradpool import runtime as runtime_module
from gradpool.testing import FaultInjectingCommunicator
from host_reads import count_host_reads
from hyper_parallel import DeviceMesh, clip_grad_norm_, fully_shard
from hyper_parallel.core.fully_shard.api import MixedPrecisionPolicy

ms.set_device("CPU")
MAIN_GRAD = MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)


class Weight(nn.Cell):
    def __init__(self, values, name):
        super().__init__()
        self.weight = Parameter(ms.Tensor(values), name=name)

    def construct(self, x):
        return mint.matmul(x, self.weight.T)


class Two(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(5)
        self.a = Weight(rng.standard_normal((5, 4)).astype(np.float32), "a")
        self.b = Weight(rng.standard_normal((3, 5)).astype(np.float32), "b")

    def construct(self, x):
        return self.b(mint.tanh(self.a(x)))


X = ms.Tensor(np.random.default_rng(6).standard_normal((2, 4)).astype(np.float32))


def grads_of(net):
    return ms.value_and_grad(lambda x: (net(x) ** 2).sum(), None, net.trainable_params())(X)[1]


@pytest.fixture
def delayed(monkeypatch):
    """Every runtime built in the test uses a communicator whose collectives complete late."""
    comm = FaultInjectingCommunicator(SingleProcessCommunicator(), delay_seconds=0.2)
    monkeypatch.setattr(runtime_module, "communicator_for", lambda device, group=None: comm)
    runtime_module.reset_runtimes()
    yield comm
    runtime_module.reset_runtimes()


# -- mesh ---------------------------------------------------------------------------------------
def test_mesh_coordinates_and_sub_meshes_are_row_major():
    mesh = DeviceMesh("cpu", (2, 3), ("dp", "fsdp"))
    assert mesh.coordinates(4) == (1, 1) and mesh.coordinates(2) == (0, 2)
    assert mesh["fsdp"].ranks == (0, 1, 2) and mesh["dp"].ranks == (0, 3)   # this rank: 0
    assert mesh[("fsdp", "dp")].mesh_shape == (3, 2)
    assert mesh.size() == 6 and mesh.size("fsdp") == 3 and mesh.ndim == 2
    assert mesh.get_local_rank("fsdp") == 0


@pytest.mark.parametrize("make, needle", [
    (lambda: DeviceMesh("cpu", (2, 2), ("a", "a")), "repeat"),
    (lambda: DeviceMesh("cpu", (2, 2), ("a",)), "1 names for a 2-D"),
    (lambda: DeviceMesh("cpu", (2, 0)), "mesh_shape"),
    (lambda: DeviceMesh("gpu", (2,)), "'gpu'"),
    (lambda: DeviceMesh("cpu", (2, 2), ("a", "b"))["c"], "no dim named 'c'"),
    (lambda: DeviceMesh("cpu", (2,), ranks=(0, 0)), "distinct ranks"),
])
def test_bad_meshes_are_refused(make, needle):
    with pytest.raises(InvalidArgumentError, match=needle):
        make()


@pytest.mark.parametrize("mesh, needle", [
    (DeviceMesh("cpu", (1, 1, 1)), "3-D mesh"),
    (DeviceMesh("cpu", (2,)), "mesh covers 2 ranks but the world size is 1"),
    (DeviceMesh("cpu", (1,), ranks=(3,)), "must exist"),
])
def test_fully_shard_refuses_a_mesh_it_cannot_use(mesh, needle):
    net = Two()
    with pytest.raises(InvalidArgumentError, match=needle):
        fully_shard(net, mesh=mesh)
    assert "_hsdp_state" not in net.__dict__


# -- reduce controls ----------------------------------------------------------------------------
SETTERS = ["set_requires_gradient_sync", "set_requires_all_reduce", "set_is_last_backward",
           "set_reshard_after_forward", "set_reshard_after_backward"]


@pytest.mark.parametrize("setter", SETTERS)
@pytest.mark.parametrize("value", [1, "false", None])
def test_setters_take_bools_only(setter, value):
    net = fully_shard(Two())
    with pytest.raises(ValueError, match=repr(value)):
        getattr(net, setter)(value)


@pytest.mark.parametrize("factor", [0, -1.0, math.nan, math.inf, "2", True])
def test_gradient_scaling_factor_must_be_finite_and_positive(factor):
    with pytest.raises(ValueError, match="finite number > 0"):
        fully_shard(Two()).set_gradient_scaling_factor(factor)


def test_gradient_scaling_factor_scales_the_reduced_gradients():
    want = [g.asnumpy() for g in grads_of(Two())]
    for async_reduce in (False, True):
        net = fully_shard(Two(), mp_policy=MAIN_GRAD,
                          pool_config=GradPoolConfig(async_reduce=async_reduce))
        net.set_gradient_scaling_factor(0.25)
        got = grads_of(net)
        for g, w, p in zip(got, want, net.trainable_params()):
            # main_grad mode hands autograd zeros; the scaled reduce is in main_grad
            np.testing.assert_array_equal(g.asnumpy(), 0 * w)
            np.testing.assert_allclose(p.main_grad.asnumpy(), 0.25 * w, rtol=1e-6)


class ManualFence:
    def __init__(self):
        self.waited = False

    def is_completed(self):
        return self.waited

    def wait(self):
        self.waited = True


@pytest.mark.parametrize("last", [True, False])
def test_is_last_backward_decides_whether_the_root_drains_the_pool(last):
    """The synchronous reduce path leaves nothing of its own in flight; what is (here a bucket
    released on a collective that has not completed) the root waits for at the end of the last
    backward, and leaves alone otherwise."""
    config = GradPoolConfig(max_buckets_in_flight=None, alignment_bytes=8)
    net = Two()
    fully_shard(net.a, pool_config=config)
    fully_shard(net, pool_config=config)
    net.set_is_last_backward(last)
    pool = runtime_module.runtime_for(config).pool
    fence = ManualFence()
    pool.acquire(64, ms.float32).release(fence)
    grads_of(net)
    assert fence.waited == last
    assert (pool.stats().fenced_buckets == 0) == last


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_backward_drops_what_unshard_installed(reshard):
    net = fully_shard(Two())
    net.set_reshard_after_forward(False)        # so only the backward decides
    net.set_reshard_after_backward(reshard)
    handle = net.unshard(async_op=True)
    handle.wait()
    assert "weight" in net.a.__dict__
    grads_of(net)
    assert ("weight" in net.a.__dict__) == (not reshard)
    net.reshard()
    assert "weight" not in net.a.__dict__


def test_a_list_is_one_unit_reduced_once(delayed):
    want = [g.asnumpy() for g in grads_of(Two())]
    net = Two()
    fully_shard([net.a, net.b], comm_fusion=True)
    assert net.a.__dict__["_hsdp_state"] is net.b.__dict__["_hsdp_state"]
    fully_shard(net)
    before = delayed.launch_counts["reduce_scatter"]
    got = grads_of(net)
    assert delayed.launch_counts["reduce_scatter"] - before == 1, "one fused reduce for a and b"
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.asnumpy(), w, rtol=1e-6)


def test_separate_calls_are_separate_units(delayed):
    net = Two()
    fully_shard(net.a, comm_fusion=True)
    fully_shard(net.b, comm_fusion=True)
    fully_shard(net)
    before = delayed.launch_counts["reduce_scatter"]
    grads_of(net)
    assert delayed.launch_counts["reduce_scatter"] - before == 2


# -- clip_grad_norm_ ----------------------------------------------------------------------------
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_equals_numpy_and_scales_main_grad(norm_type):
    want = [g.asnumpy().astype(np.float64) for g in grads_of(Two())]
    net = Two()
    fully_shard(net, mp_policy=MAIN_GRAD, replicate_params={net.b.weight})
    grads_of(net)
    flat = np.concatenate([w.ravel() for w in want])
    expected = np.linalg.norm(flat, ord=norm_type)
    params = net.trainable_params()
    before = [p.main_grad.asnumpy().copy() for p in params]
    norm = clip_grad_norm_(params, expected / 2, norm_type=norm_type)
    assert norm.shape == () and norm.dtype == ms.float32
    np.testing.assert_allclose(float(norm.asnumpy()), expected, rtol=1e-6)
    coef = (expected / 2) / (float(norm.asnumpy()) + 1e-6)
    for p, b in zip(params, before):
        np.testing.assert_allclose(p.main_grad.asnumpy(), b * coef, rtol=1e-6)
    unchanged = [p.main_grad.asnumpy().copy() for p in params]
    clip_grad_norm_(params, 1e9, norm_type=norm_type)      # below max_norm: nothing changes
    for p, u in zip(params, unchanged):
        np.testing.assert_array_equal(p.main_grad.asnumpy(), u)


def test_clip_grad_norm_scales_bfloat16_gradients_in_place():
    """Gradients of another dtype than the float32 norm (the CPU has no bfloat16 x float32 Mul)
    are scaled into their own memory too, against NumPy."""
    rng = np.random.default_rng(3)
    values = [rng.standard_normal(n).astype(np.float32) for n in (5, 12)]
    params = [Parameter(ms.Tensor(np.zeros_like(v)), name=f"w{i}") for i, v in enumerate(values)]
    grads = [ms.Tensor(v).astype(ms.bfloat16) for v in values]
    exact = [g.astype(ms.float32).asnumpy().astype(np.float64) for g in grads]
    norm = float(np.linalg.norm(np.concatenate(exact)))
    got = clip_grad_norm_(params, norm / 4, grads=grads)
    np.testing.assert_allclose(float(got.asnumpy()), norm, rtol=1e-6)
    for g, e in zip(grads, exact):
        assert g.dtype == ms.bfloat16
        np.testing.assert_allclose(g.astype(ms.float32).asnumpy(), e / 4, rtol=1e-2)


def test_clip_grad_norm_scales_a_gradient_viewing_part_of_a_larger_storage():
    """A gradient that is a prefix view of a larger tensor is scaled in place there, the rest of
    the storage untouched (copy_ would refuse such a view on CPU)."""
    values = np.arange(1, 13, dtype=np.float32)
    storage = ms.Tensor(values.copy())
    grad = storage[:5]
    params = [Parameter(ms.Tensor(np.zeros(5, np.float32)), name="w")]
    norm = float(np.linalg.norm(values[:5]))
    clip_grad_norm_(params, norm / 2, grads=[grad])
    want = values.copy()
    want[:5] *= (norm / 2) / (norm + 1e-6)
    np.testing.assert_allclose(storage.asnumpy(), want, rtol=1e-6)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_norm=0), "max_norm"), (dict(max_norm=math.inf), "finite"),
    (dict(max_norm=1.0, norm_type=-2), "norm_type"), (dict(max_norm="1"), "max_norm"),
    (dict(max_norm=1.0, grads=[]), "grads has 0 entries"),
])
def test_clip_grad_norm_refuses_bad_arguments(kwargs, needle):
    net = fully_shard(Two(), mp_policy=MAIN_GRAD)
    with pytest.raises(InvalidArgumentError, match=needle):
        clip_grad_norm_(net.trainable_params(), **kwargs)


@pytest.mark.parametrize("bad, norm_type, want", [
    (math.nan, 2.0, math.nan), (math.inf, 2.0, math.inf), (math.inf, math.inf, math.inf),
    (math.nan, 1.0, math.nan)])
def test_clip_grad_norm_of_a_nonfinite_gradient_clips_nothing(bad, norm_type, want):
    net = Two()
    fully_shard(net, mp_policy=MAIN_GRAD, replicate_params={net.b.weight})
    grads_of(net)
    params = net.trainable_params()
    values = params[0].main_grad.asnumpy().copy()
    values.reshape(-1)[0] = bad
    params[0].main_grad = ms.Tensor(values)
    before = [p.main_grad.asnumpy().copy() for p in params]
    norm = float(clip_grad_norm_(params, 1e-3, norm_type=norm_type).asnumpy())
    assert (math.isnan(norm) if math.isnan(want) else norm == want), norm
    for p, b in zip(params, before):          # max_norm is tiny: a finite norm would clip
        np.testing.assert_array_equal(p.main_grad.asnumpy(), b)
    with pytest.raises(NonFiniteNormError, match="norm of the gradients is"):
        clip_grad_norm_(params, 1e-3, norm_type=norm_type, error_if_nonfinite=True)


@pytest.mark.parametrize("norm_type", [2.0, 3.0, math.inf])
def test_clip_grad_norm_never_reads_the_device(monkeypatch, norm_type):
    """The norm, the coefficient and the scaling stay on device: no device-to-host read per
    call, however many parameters, clipping or not; ``error_if_nonfinite=True`` reads the norm
    once (the read the caller asked for)."""
    net = Two()
    fully_shard(net, mp_policy=MAIN_GRAD, replicate_params={net.b.weight})
    grads_of(net)
    params = net.trainable_params()
    flat = np.concatenate([p.main_grad.asnumpy().astype(np.float64).ravel() for p in params])
    want = np.abs(flat).max() if math.isinf(norm_type) else (np.abs(flat) ** norm_type).sum() \
        ** (1 / norm_type)
    before = [p.main_grad.asnumpy().copy() for p in params]
    with count_host_reads() as reads:
        norm = clip_grad_norm_(params, want / 3, norm_type=norm_type)
    assert len(params) > 1 and reads.calls == {}, reads.calls
    np.testing.assert_allclose(float(norm.asnumpy()), want, rtol=1e-6)
    coef = (want / 3) / (want + 1e-6)
    for p, b in zip(params, before):
        np.testing.assert_allclose(p.main_grad.asnumpy(), b * coef, rtol=1e-5)
    with count_host_reads() as reads:
        clip_grad_norm_(params, 1e9, norm_type=norm_type, error_if_nonfinite=True)
    assert sum(reads.calls.values()) == 1, reads.calls
