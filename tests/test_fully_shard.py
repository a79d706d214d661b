"""hyper_parallel's fully_shard in one process (world size 1, no msrun): surface, training against
the unsharded reference, the per-parameter reduce API, and typed errors for bad input (its
policies' and keywords' table of the bad-input matrix); a call that fails leaves the module as it
was."""
import importlib
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, mint, nn

from gradpool.app.model import TinyDeepSeekV3, make_batch, next_token_loss
from gradpool.app.train import build_sharded_model, train_sharded
from gradpool import GradPoolConfig
from gradpool.app.config import from_dict
from gradpool.errors import GradientIntegrityError, InvalidArgumentError, PoolCapacityError
from hyper_parallel import fully_shard, hsdp_sync_stream, init_device_mesh
from hyper_parallel.core.device_mesh import DeviceMesh
from hyper_parallel.core.dtensor.placement_types import Shard
from hyper_parallel.core.fully_shard.api import HSDPModule, MixedPrecisionPolicy
from hyper_parallel.core.fully_shard.utils import CPUOffloadPolicy, OffloadPolicy
from hyper_parallel.platform.mindspore.fully_shard.param import MindSporeHSDPParamV2
from gradpool.runtime import runtime_for
from bad_inputs import FULLY_SHARD_CASES, Net, assert_refused_typed

DIST_DIR = Path(__file__).parent / "distributed"
sys.path.insert(0, str(DIST_DIR))
import harness  # noqa: E402
import fsdp_cases  # noqa: E402  (the rank-side fully_shard cases, here at world size 1)

ms.set_device("CPU")
FIELD = ["fully_shard.reduce_dtype=float32", "fully_shard.apply_grad_on_fp32_main_grad=true",
         "gradpool.poison_on_release=true", "gradpool.verify_gradients=true", "train.steps=3"]


def test_upstream_import_paths():
    api = importlib.import_module("hyper_parallel.core.fully_shard.api")
    utils = importlib.import_module("hyper_parallel.core.fully_shard.utils")
    placement = importlib.import_module("hyper_parallel.core.dtensor.placement_types")
    for name in ("fully_shard", "HSDPModule", "hsdp_sync_stream", "MixedPrecisionPolicy"):
        assert hasattr(api, name)
    for name in ("MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"):
        assert hasattr(utils, name)
    assert placement.Shard(1).dim == 1
    assert utils.MixedPrecisionPolicy() == utils.MixedPrecisionPolicy(
        param_dtype=None, reduce_dtype=None, output_dtype=None, cast_forward_inputs=True,
        apply_grad_on_fp32_main_grad=False)
    param_mod = importlib.import_module("hyper_parallel.platform.mindspore.fully_shard.param")
    for method in ("reduce_comm_dtype", "reduce_scatter_grad", "reduce_scatter_output",
                   "clear_reduce_scatter_output", "apply_reduced_grad"):
        assert callable(getattr(param_mod.MindSporeHSDPParamV2, method))


@pytest.mark.parametrize("extra", [[], ["fully_shard.comm_fusion=true"], ["train.micro_steps=2"]],
                         ids=["field", "comm_fusion", "micro_steps"])
def test_world_one_training_equals_unsharded_reference(extra):
    cfg = from_dict({}, FIELD + extra)
    model = build_sharded_model(cfg)
    assert isinstance(model, HSDPModule)
    runtime = runtime_for(cfg.gradpool)
    records = train_sharded(cfg, model, runtime.comm, runtime.pool)
    harness.assert_trains_like_unsharded(cfg, model, records, rtol=1e-6, atol=1e-7)
    assert [r.new_allocations for r in records[1:]] == [0] * (len(records) - 1)
    managed = [p.hsdp_param for p in model.trainable_params()]
    assert {p.verified_gradients for p in managed} == {cfg.train.steps * cfg.train.micro_steps}
    hsdp_sync_stream()
    assert runtime.pool.stats().fenced_buckets == 0


# The distributed fully_shard cases (gradient probe: reduced shard grads and main_grad after one
# and several micro-steps, per element; training against the exact reference), in one process.
# One case here (each costs seconds); all of them run at world size 2, some at 4.
WORLD_1_CASES = ["field_configuration"]


@pytest.mark.parametrize("name", WORLD_1_CASES)
def test_fully_shard_case_world_size_1(name, tmp_path):
    fsdp_cases.suite.main([str(tmp_path), name])      # outside msrun: SingleProcessCommunicator
    results = harness.load_results(tmp_path, fsdp_cases.suite.name, nproc=1)
    assert results.reports[0]["world_size"] == 1
    results.verify(name)


class TwoLayer(nn.Cell):
    def __init__(self):
        super().__init__()
        rng = np.random.default_rng(3)
        self.w = Parameter(ms.Tensor(rng.standard_normal((5, 4)).astype(np.float32)), name="w")
        self.v = Parameter(ms.Tensor(rng.standard_normal((3, 5)).astype(np.float32)), name="v")

    def construct(self, x):
        return mint.matmul(mint.matmul(x, self.w.T), self.v.T)


def _loss_and_grads(net, x):
    return ms.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())(x)


def test_main_grad_accumulates_and_zero_grad_clears_it():
    x = ms.Tensor(np.ones((2, 4), np.float32))
    ref_loss, ref_grads = _loss_and_grads(TwoLayer(), x)
    net = fully_shard(TwoLayer(), mp_policy=MixedPrecisionPolicy(
        reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True),
        pool_config=GradPoolConfig(async_reduce=False))
    loss, grads = _loss_and_grads(net, x)
    pool = net.trainable_params()[0].hsdp_param.unit.reducer.pool
    # main_grad mode: autograd gets zeros and the output buckets are back in the pool already
    assert not any(np.any(g.asnumpy()) for g in grads)
    assert pool.stats().live_leases == 0
    for param, want in zip(net.trainable_params(), ref_grads):
        np.testing.assert_allclose(param.main_grad.asnumpy(), want.asnumpy(), rtol=1e-6)
    _loss_and_grads(net, x)
    for param, want in zip(net.trainable_params(), ref_grads):
        assert param.main_grad.dtype == ms.float32
        np.testing.assert_allclose(param.main_grad.asnumpy(), 2 * want.asnumpy(), rtol=1e-6)
    net.zero_grad()
    for param in net.trainable_params():    # zeros, so a unit that does not run still steps
        assert param.main_grad.dtype == ms.float32 and not np.any(param.main_grad.asnumpy())
        assert tuple(param.main_grad.shape) == param.hsdp_param.local_shape


def test_param_reduce_api_keeps_the_gradient_alive():
    """The upstream per-parameter calls, driven by hand: the gradient is never freed."""
    net = fully_shard(TwoLayer(), pool_config=GradPoolConfig(poison_on_release=True))
    managed: MindSporeHSDPParamV2 = net.trainable_params()[0].hsdp_param
    grad = ms.Tensor(np.arange(20, dtype=np.float32).reshape(5, 4))
    before = (grad.untyped_storage().size(), grad.asnumpy().copy())
    assert managed.reduce_comm_dtype(grad) == ms.float32
    managed.set_unsharded_grad(grad.to(ms.float32))          # the aliasing .to() of the seed
    managed.reduce_scatter_grad(async_op=True, reduce_op="sum")
    view = managed.reduced_shard()
    shard = managed.reduce_scatter_output()
    np.testing.assert_array_equal(shard.asnumpy(), before[1])
    managed.clear_reduce_scatter_output()
    assert grad.untyped_storage().size() == before[0]
    np.testing.assert_array_equal(grad.asnumpy(), before[1])
    assert np.isnan(view.asnumpy()).all(), "a released output is recycled (poisoned), not kept"
    np.testing.assert_array_equal(shard.asnumpy(), before[1])   # the caller's copy is its own


def test_unshard_and_reshard_install_full_parameters():
    net = fully_shard(TwoLayer())
    shard = net.trainable_params()[0]
    net.unshard()
    installed = net.__dict__["w"]      # at world size 1 the gathered parameter is the shard;
    assert tuple(installed.shape) == (5, 4)   # the 2-rank cases check real gathers
    np.testing.assert_array_equal(installed.asnumpy(), shard.asnumpy())
    net.reshard()
    assert "w" not in net.__dict__


def test_hsdp_sync_stream_waits_for_fenced_buckets():
    class Fence:
        waited = False

        def is_completed(self):
            return self.waited

        def wait(self):
            self.waited = True

    config = GradPoolConfig(alignment_bytes=8)
    fully_shard(TwoLayer(), pool_config=config)
    pool = runtime_for(config).pool
    fence = Fence()
    pool.acquire(16, ms.float32).release(fence)
    assert pool.stats().fenced_buckets == 1
    hsdp_sync_stream()
    assert fence.waited and pool.stats().fenced_buckets == 0
    hsdp_sync_stream()                      # nothing in flight: returns at once


class Tied(nn.Cell):
    """One Parameter used by two cells (tied weights)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = TwoLayer(), TwoLayer()
        self.b.w = self.a.w

    def construct(self, x):
        return mint.matmul(self.a(x), self.b(x).T)


def test_tied_parameter_is_sharded_once_and_gets_both_uses_gradients():
    x = ms.Tensor(np.ones((2, 4), np.float32))
    ref = Tied()
    _, ref_grads = _loss_and_grads(ref, x)
    net = fully_shard(Tied())
    assert [p.name for p in net.trainable_params()] == [p.name for p in ref.trainable_params()]
    _, grads = _loss_and_grads(net, x)
    for got, want in zip(grads, ref_grads):
        np.testing.assert_allclose(got.asnumpy(), want.asnumpy(), rtol=1e-5)


def test_tied_parameter_across_units_is_refused():
    net = Tied()
    fully_shard(net.a)
    with pytest.raises(InvalidArgumentError) as err:
        fully_shard(net)
    assert "a.w" in str(err.value) and "tied" in str(err.value)


def test_failed_reduce_leaves_no_lease_behind():
    """A fused backward whose second group cannot get a bucket gives back the first group's."""
    config = GradPoolConfig(max_cached_mib=100 / 2 ** 20, alignment_bytes=8)   # 100 bytes
    net = TwoLayer()
    fully_shard(net, comm_fusion=True, replicate_params={net.v}, pool_config=config)
    with pytest.raises(PoolCapacityError):
        _loss_and_grads(net, ms.Tensor(np.ones((2, 4), np.float32)))
    pool = runtime_for(config).pool
    net.zero_grad()
    assert pool.stats().live_leases == 0


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("fusion", [["fully_shard.comm_fusion=false"],
                                    ["fully_shard.comm_fusion=true", "gradpool.bucket_cap_mib=0.01"]],
                         ids=["per_gradient", "fused_small_buckets"])
def test_training_correct_when_collectives_complete_late(fusion, mode):
    """Every collective runs at wait(), 20 ms after launch at the earliest, and reads its input
    bucket then, like a real asynchronous collective. A unit packs and launches bucket after
    bucket before it waits, so each input bucket must stay fenced while the next is packed: one
    handed out early is overwritten by the next gradient (or poisoned with NaN) before its
    collective reads it, and the gradients, the losses and the parameters come out wrong. The
    asynchronous reduce (main_grad mode) leaves every unit's collectives pending until the root's
    backward ends: main_grad must still be the reference's gradient, bit for bit."""
    cfg = from_dict({}, FIELD + ["train.steps=2", "gradpool.max_buckets_in_flight=null",
                                 f"gradpool.async_reduce={mode == 'async'}"] + fusion)
    with harness.late_communicators() as made:
        model = build_sharded_model(cfg)
        runtime = runtime_for(cfg.gradpool)
        assert runtime.comm is made[0]
        ref = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
        _, ref_grads = ms.value_and_grad(lambda t: next_token_loss(ref, t), None,
                                         ref.trainable_params())(make_batch(cfg.model, 0,
                                                                            seed=cfg.train.seed))
        params = model.trainable_params()
        grad_fn = ms.value_and_grad(lambda t: next_token_loss(model, t), None, params)
        _, grads = grad_fn(make_batch(cfg.model, 0, seed=cfg.train.seed))
        assert made[0].launch_counts["reduce_scatter"] > 3      # several buckets per unit
        # the values first: an early reuse of an input bucket shows as wrong (or NaN) gradients
        for param, got, want in zip(params, grads, ref_grads):
            assert not np.any(got.asnumpy()), param.name      # main_grad mode: it went there
            np.testing.assert_array_equal(param.main_grad.asnumpy(), want.asnumpy(),
                                          err_msg=param.name)
        model.zero_grad()
        records = train_sharded(cfg, model, runtime.comm, runtime.pool)
    harness.assert_trains_like_unsharded(cfg, model, records)


# -- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["max", "mean", ""])
def test_reduce_op_other_than_avg_or_sum(op):
    net = fully_shard(TwoLayer())
    with pytest.raises(InvalidArgumentError) as err:
        net.set_reduce_op_type(op)
    assert repr(op) in str(err.value) and "avg" in str(err.value)


def test_mesh_size_must_equal_world_size():
    with pytest.raises(InvalidArgumentError) as err:
        fully_shard(TwoLayer(), mesh=DeviceMesh("cpu", (2,)))
    assert "mesh covers 2 ranks but the world size is 1" in str(err.value)
    with pytest.raises(InvalidArgumentError) as err:
        init_device_mesh("cpu", (4,))
    assert "covers 4 ranks but the job has 1" in str(err.value)
    assert init_device_mesh("cpu", (1,)).size() == 1


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype"])
@pytest.mark.parametrize("dtype", [ms.int32, ms.bool_])
def test_non_floating_dtypes_are_refused(field, dtype):
    with pytest.raises(InvalidArgumentError) as err:
        fully_shard(TwoLayer(), mp_policy=MixedPrecisionPolicy(**{field: dtype}))
    assert f"mp_policy.{field}" in str(err.value) and str(dtype) in str(err.value)


def test_fully_shard_twice_on_one_module():
    net = fully_shard(TwoLayer())
    with pytest.raises(InvalidArgumentError) as err:
        fully_shard(net)
    assert "already applied" in str(err.value)


def test_cpu_offload_is_refused_and_default_offload_accepted():
    with pytest.raises(InvalidArgumentError) as err:
        fully_shard(TwoLayer(), offload_policy=CPUOffloadPolicy())
    assert "CPUOffloadPolicy is not supported" in str(err.value)
    assert isinstance(fully_shard(TwoLayer(), offload_policy=OffloadPolicy()), HSDPModule)


def test_param_dtype_computes_in_bfloat16_and_output_dtype_casts_outputs():
    seen = {}

    class Scale(nn.Cell):
        """Elementwise only: MindSpore's CPU MatMul has no bfloat16 kernel."""

        def __init__(self):
            super().__init__()
            values = np.arange(1, 21, dtype=np.float32).reshape(5, 4) / 8
            self.w = Parameter(ms.Tensor(values), name="w")

        def construct(self, x):
            seen["weight"], seen["input"] = self.w.dtype, x.dtype
            return mint.mul(x, self.w)

    x = ms.Tensor(np.full((5, 4), 0.5, np.float32))
    _, ref_grads = _loss_and_grads(Scale(), x)
    net = fully_shard(Scale(), mp_policy=MixedPrecisionPolicy(
        param_dtype=ms.bfloat16, reduce_dtype=ms.float32, output_dtype=ms.float16))
    assert net(x).dtype == ms.float16
    assert seen == {"weight": ms.bfloat16, "input": ms.bfloat16}
    _, grads = _loss_and_grads(net, x)
    assert grads[0].dtype == ms.float32                      # the shard parameter's dtype
    np.testing.assert_allclose(grads[0].asnumpy(), ref_grads[0].asnumpy(), rtol=1e-2)


@pytest.mark.parametrize("damage", ["changed", "freed"])
def test_gradient_verification_catches_a_damaged_gradient(damage):
    """verify_gradients really compares: a gradient changed or freed while the reduce path holds
    it raises GradientIntegrityError (what `gradpool train` turns into a failed run)."""
    net = fully_shard(TwoLayer(), pool_config=GradPoolConfig(verify_gradients=True))
    managed = net.trainable_params()[0].hsdp_param
    grad = ms.Tensor(np.arange(20, dtype=np.float32).reshape(5, 4))
    managed.set_unsharded_grad(grad)
    managed.reduce_scatter_grad(async_op=True, reduce_op="avg")
    if damage == "changed":
        grad.asnumpy()[0, 0] = -1.0            # on CPU asnumpy() is the tensor's own memory
    else:
        grad.untyped_storage().resize_(0)      # what the seed bug did to the caller's gradient
    with pytest.raises(GradientIntegrityError) as err:
        managed.reduce_scatter_output()
    assert managed.name in str(err.value)
    assert ("changed" if damage == "changed" else "lost its storage") in str(err.value)


def test_fully_shard_without_pool_config_takes_the_process_default():
    """A caller that cannot pass pool_config (mindformers' apply_fsdp calls fully_shard itself)
    gets the options set_default_pool_config made the default; the previous default comes back."""
    from gradpool import default_pool_config, set_default_pool_config
    x = ms.Tensor(np.ones((2, 4), np.float32))
    previous = set_default_pool_config(GradPoolConfig(verify_gradients=True, async_reduce=False))
    try:
        net = fully_shard(TwoLayer())
        _loss_and_grads(net, x)
    finally:
        assert set_default_pool_config(previous).verify_gradients
    assert default_pool_config() == GradPoolConfig() == previous
    managed = [p.hsdp_param for p in net.trainable_params()]
    assert [m.verified_gradients for m in managed] == [1] * len(managed)
    assert not fully_shard(TwoLayer()).trainable_params()[0].hsdp_param.verify_gradients
    with pytest.raises(InvalidArgumentError, match="GradPoolConfig"):
        set_default_pool_config({"verify_gradients": True})


def test_the_parameters_the_model_was_built_with_are_released():
    """After fully_shard only the local shards are referenced: the full Parameters the model was
    built with are garbage (nothing of fully_shard keeps them), so their memory is MindSpore's
    to reuse."""
    import gc
    import weakref
    net = TwoLayer()
    originals = [weakref.ref(p) for p in net.trainable_params()]
    fully_shard(net)
    gc.collect()
    assert [ref() for ref in originals] == [None] * len(originals)
    assert all(hasattr(p, "hsdp_param") for p in net.trainable_params())


def test_the_replaced_parameters_are_freed_before_the_first_forward_without_a_collection():
    """A MindSpore Parameter and its ParamInfo refer to each other, so the replaced full
    parameters wait for the cycle collector; the first forward runs it once (and on CPU hands
    the freed host memory back), so their memory does not stay for a collector that may not run
    before the step's peak. The collector is off here: only fully_shard's own collection can
    free them."""
    import gc
    import weakref
    from unittest import mock
    import gradpool.device
    x = ms.Tensor(np.ones((2, 4), np.float32))
    gc.disable()
    try:
        net = TwoLayer()
        originals = [weakref.ref(p) for p in net.trainable_params()]
        fully_shard(net)
        assert all(ref() is not None for ref in originals), "nothing to free: not a test"
        with mock.patch.object(gradpool.device, "_malloc_trim") as trim:
            net(x)
            net(x)
        assert [ref() for ref in originals] == [None] * len(originals)
        trim.return_value.assert_called_once_with(0)        # once, not at every forward
    finally:
        gc.enable()


# -- fully_shard is transactional -----------------------------------------------------------------
def _state(net):
    return {name: (id(cell._params.get(attr)), cell._params.get(attr).asnumpy().tobytes())
            for name, cell in net.cells_and_names() for attr in cell._params} | {
        "markers": [hasattr(p, "hsdp_managed_by") or hasattr(p, "hsdp_param")
                    for p in net.trainable_params()],
        "unit": "_hsdp_state" in net.__dict__, "class": type(net)}


def _bad_placement(param):
    return Shard(3) if param.name == "v" else Shard(0)


def _raising_placement(param):
    if param.name == "v":
        raise KeyError("no rule for v")
    return Shard(0)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(shard_placement_fn=_bad_placement, replicate_params=None), "Shard(dim=3)"),
    (dict(shard_placement_fn=_raising_placement, replicate_params=None), "no rule for v"),
    (dict(replicate_params=None), "0-d"),
], ids=["bad Shard(dim)", "raising shard_placement_fn", "0-d parameter"])
def test_a_failing_fully_shard_leaves_the_module_as_it_was(kwargs, needle):
    net = Net()
    params_before = list(net.trainable_params())
    before = _state(net)
    with pytest.raises(InvalidArgumentError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        fully_shard(net, **kwargs)
    assert _state(net) == before
    assert all(a is b for a, b in zip(net.trainable_params(), params_before))
    fully_shard(net, replicate_params={net.s})          # corrected: manages every parameter
    managed = [p.hsdp_param for p in net.trainable_params()]
    assert {m.name for m in managed} == {"w", "v", "s"}
    x = ms.Tensor(np.ones((2, 4), np.float32))
    loss, grads = ms.value_and_grad(lambda x: net(x).sum(), None, net.trainable_params())(x)
    assert len(grads) == 3 and np.isfinite(float(loss.asnumpy()))


# -- policies' and keywords' table of the bad-input matrix (tests/bad_inputs.py) ------------------
@pytest.mark.parametrize("name", sorted(FULLY_SHARD_CASES))
def test_bad_input_is_refused_typed_naming_the_value(name):
    assert_refused_typed(name)
