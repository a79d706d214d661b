"""The asynchronous reduce of main_grad mode, in one process (world size 1).

A unit's backward only launches its reduce; the results land in ``main_grad`` once, when the
unit after the next one launches its reduce or when the backward pass ends (or at
``hsdp_sync_stream()`` / ``zero_grad()``). Collectives here come from
``FaultInjectingCommunicator(read_input_at="wait")``: a collective runs, reads its input and
writes its output only when its handle is waited on, so a result read before its wait, an input
bucket reused before its fence, or a reduce applied twice changes the values compared below
against the unsharded model (bit for bit: at world size 1 the arithmetic is the same).
"""
import contextlib

import harness
import mindspore as ms
import numpy as np
import pytest

from gradpool import GradPoolConfig
from gradpool import runtime as runtime_module
from gradpool.app.config import from_dict
from gradpool.app.model import TinyDeepSeekV3, make_batch, next_token_loss
from gradpool.app.train import build_sharded_model, train_sharded
from gradpool.errors import CollectiveError, CommError, InvalidArgumentError
from gradpool.runtime import runtime_for
from gradpool.testing import FaultInjectingCommunicator
from hyper_parallel import hsdp_sync_stream
from hyper_parallel.platform.mindspore.fully_shard.runtime import RUNTIME

ms.set_device("CPU")
FIELD = ["fully_shard.reduce_dtype=float32", "fully_shard.apply_grad_on_fp32_main_grad=true",
         "gradpool.poison_on_release=true", "gradpool.verify_gradients=true", "train.steps=2",
         "gradpool.max_buckets_in_flight=null"]
FUSED = ["fully_shard.comm_fusion=true", "gradpool.bucket_cap_mib=0.01"]   # several per unit


class FailNth(FaultInjectingCommunicator):
    """Late collectives of which only launch number ``n`` (counted from 1) of ``name`` fails."""

    def __init__(self, inner, n: int, name: str = "reduce_scatter"):
        super().__init__(inner, delay_seconds=0.0, read_input_at="wait")
        self.n, self.name = n, name

    def _error_for(self, name):
        if name == self.name and self.launch_counts[name] == self.n:
            return CommError(f"injected failure of {name} launch #{self.n}")
        return None


@pytest.fixture
def comms():
    """``install(wrap)``: every runtime built afterwards gets ``wrap(communicator)``."""
    with contextlib.ExitStack() as stack:
        yield lambda wrap: stack.enter_context(harness.wrapped_communicators(wrap))
    RUNTIME.in_flight_refs.clear()     # a failed test must not leak units into the next


def late(inner):
    return FaultInjectingCommunicator(inner, delay_seconds=0.02, read_input_at="wait")


def _reference_grads(cfg, index: int = 0) -> list[np.ndarray]:
    ref = TinyDeepSeekV3(cfg.model, seed=cfg.train.seed)
    _, grads = ms.value_and_grad(lambda t: next_token_loss(ref, t), None, ref.trainable_params())(
        make_batch(cfg.model, index, seed=cfg.train.seed))
    return [g.asnumpy() for g in grads]


def _grad_fn(model):
    return ms.value_and_grad(lambda t: next_token_loss(model, t), None, model.trainable_params())


def _main_grads(model) -> list:
    return [None if p.main_grad is None else p.main_grad.asnumpy().copy()
            for p in model.trainable_params()]


def _all_zero(main_grads: list) -> bool:
    """Every main_grad is zeros (what zero_grad leaves, so a unit that does not run still steps)."""
    return all(g is not None and not np.any(g) for g in main_grads)


def _non_root_units(model):
    units = model._hsdp_units()       # pylint: disable=protected-access
    assert len(units) == 3            # two decoder layers and the root
    return [u for u in units if not u.is_root]


@pytest.mark.parametrize("fusion", [[], FUSED], ids=["per_gradient", "fused"])
def test_async_training_with_micro_steps_equals_the_reference(comms, fusion):
    """Two micro-steps per step (the first accumulates in the unit's buckets, no collective),
    late collectives: losses and parameters equal the unsharded run's, bit for bit."""
    comms(late)
    cfg = from_dict({}, FIELD + ["train.micro_steps=2"] + fusion)
    model = build_sharded_model(cfg)
    runtime = runtime_for(cfg.gradpool)
    records = train_sharded(cfg, model, runtime.comm, runtime.pool)
    harness.assert_trains_like_unsharded(cfg, model, records)
    assert all(u.async_stats.launched == cfg.train.steps for u in model._hsdp_units())


@pytest.mark.parametrize("async_reduce", [True, False])
def test_non_root_backward_returns_before_its_collective_completed(comms, async_reduce):
    """Proof of asynchrony: when each decoder layer's backward returns, its collectives have not
    run yet (late handles complete only when waited); the root's backward ends by landing them.
    With async_reduce off, each completes inside its backward (the counter is not always 1)."""
    comms(late)
    cfg = from_dict({}, FIELD + [f"gradpool.async_reduce={async_reduce}"])
    model = build_sharded_model(cfg)
    _grad_fn(model)(make_batch(cfg.model, 0, seed=cfg.train.seed))
    stats = [(u.async_stats.launched, u.async_stats.returned_in_flight, u.async_stats.finished)
             for u in _non_root_units(model)]
    assert stats == ([(1, 1, 1)] * 2 if async_reduce else [(0, 0, 0)] * 2)
    assert not RUNTIME.in_flight
    for param, want in zip(model.trainable_params(), _reference_grads(cfg)):
        np.testing.assert_array_equal(param.main_grad.asnumpy(), want, err_msg=param.name)


def test_autograd_gets_shared_zeros_and_main_grad_the_reduce(comms):
    comms(late)
    cfg = from_dict({}, FIELD)
    model = build_sharded_model(cfg)
    grad_fn = _grad_fn(model)
    _, first = grad_fn(make_batch(cfg.model, 0, seed=cfg.train.seed))
    cached = len(RUNTIME.zeros)
    model.zero_grad()
    _, second = grad_fn(make_batch(cfg.model, 0, seed=cfg.train.seed))
    assert len(RUNTIME.zeros) == cached           # no new zero tensor per step
    shapes = {(tuple(p.shape), p.dtype) for p in model.trainable_params()}
    assert set(RUNTIME.zeros) >= shapes            # one shared tensor per shape and dtype
    for got_1, got_2 in zip(first, second):
        assert not np.any(got_1.asnumpy()) and not np.any(got_2.asnumpy())
    assert not any(np.any(z.asnumpy()) for z in RUNTIME.zeros.values())   # never written
    for param, want in zip(model.trainable_params(), _reference_grads(cfg)):
        np.testing.assert_array_equal(param.main_grad.asnumpy(), want, err_msg=param.name)


def test_without_main_grad_the_reduce_stays_synchronous(comms):
    """async_reduce is on, but autograd must return the reduced shards: nothing is left in
    flight, and the returned gradients are the reference's."""
    comms(late)
    cfg = from_dict({}, FIELD + ["fully_shard.apply_grad_on_fp32_main_grad=false"])
    model = build_sharded_model(cfg)
    assert cfg.gradpool.async_reduce
    _, grads = _grad_fn(model)(make_batch(cfg.model, 0, seed=cfg.train.seed))
    for got, want in zip(grads, _reference_grads(cfg)):
        np.testing.assert_array_equal(got.asnumpy(), want)
    assert all(u.async_stats.launched == 0 for u in model._hsdp_units())


@pytest.mark.parametrize("failing", [1, 5], ids=["first_collective", "mid_backward"])
def test_a_failed_collective_reaches_value_and_grad_and_the_next_step_works(comms, failing):
    made = comms(lambda inner: FailNth(inner, failing))
    cfg = from_dict({}, FIELD + FUSED)
    model = build_sharded_model(cfg)
    pool = runtime_for(cfg.gradpool).pool
    grad_fn = _grad_fn(model)
    batch = make_batch(cfg.model, 0, seed=cfg.train.seed)
    with pytest.raises(CollectiveError, match=f"launch #{failing}") as info:
        grad_fn(batch)
    assert info.value.collective.startswith("reduce_scatter of ")      # named, typed
    assert made[0].launch_counts["reduce_scatter"] > failing     # it failed amid the others
    # met when a later unit's launch landed it, it waited for the end of backward: every unit
    # still launched its reduce (every rank runs the same collectives)
    assert [u.async_stats.launched for u in model._hsdp_units()] == [1, 1, 1]
    assert not RUNTIME.in_flight
    stats = pool.stats()
    # the failed collective's input and output buckets: quarantined, never leased again
    assert (stats.live_leases, stats.quarantined_buckets, stats.failed_fences) == (0, 2, 2)
    quarantined = [b for b in pool._buckets if b.state == "quarantined"]
    model.zero_grad()
    grad_fn(batch)                        # later launches do not fail
    for param, want in zip(model.trainable_params(), _reference_grads(cfg)):
        np.testing.assert_array_equal(param.main_grad.asnumpy(), want, err_msg=param.name)
    hsdp_sync_stream()
    stats = pool.stats()
    assert (stats.live_leases, stats.fenced_buckets, stats.quarantined_buckets) == (0, 0, 2)
    assert all(b.state == "quarantined" and b.lease is None for b in quarantined)
    pool.trim()                           # after a synchronize: freed
    assert pool.stats().quarantined_buckets == 0
    assert all(b.tensor.untyped_storage().size() == 0 for b in quarantined)


def test_reduces_left_in_flight_land_once(comms):
    """set_is_last_backward(False): value_and_grad returns with the last two units' reduces
    pending (the first one launched landed when the third launched; the others' main_grad
    untouched); hsdp_sync_stream() lands them; a backward on top of pending ones adds, and
    zero_grad() with reduces in flight waits for them, then drops everything."""
    comms(late)
    cfg = from_dict({}, FIELD)
    model = build_sharded_model(cfg)
    pool = runtime_for(cfg.gradpool).pool
    grad_fn = _grad_fn(model)
    batch = make_batch(cfg.model, 0, seed=cfg.train.seed)
    want = _reference_grads(cfg)
    model.set_is_last_backward(False)
    grad_fn(batch)
    pending = RUNTIME.in_flight
    assert len(pending) == 2 and pending[-1].is_root
    for param, got, expected in zip(model.trainable_params(), _main_grads(model), want):
        if param.hsdp_param.unit in pending:                  # not landed yet
            assert not np.any(got), param.name
        else:                                                 # landed once, early
            np.testing.assert_array_equal(got, expected, err_msg=param.name)
    hsdp_sync_stream()
    for got, expected in zip(_main_grads(model), want):
        np.testing.assert_array_equal(got, expected)
    grad_fn(batch)                       # pending again: lands at the next backward of each unit
    model.set_is_last_backward(True)
    grad_fn(batch)
    for got, expected in zip(_main_grads(model), want):
        np.testing.assert_array_equal(got, (expected + expected) + expected)    # three, once each
    model.set_is_last_backward(False)
    grad_fn(batch)
    model.zero_grad()
    assert not RUNTIME.in_flight
    assert _all_zero(_main_grads(model))
    model.set_is_last_backward(True)
    grad_fn(batch)                       # the zeroed reduce was not applied late
    for got, expected in zip(_main_grads(model), want):
        np.testing.assert_array_equal(got, expected)
    hsdp_sync_stream()
    stats = pool.stats()
    assert (stats.live_leases, stats.fenced_buckets) == (0, 0)


def test_buckets_in_flight_are_bounded_by_the_pool(comms, monkeypatch):
    """max_buckets_in_flight=1: while a backward leaves collectives pending, at most one input
    bucket per dtype is fenced at any time; acquires wait for the oldest (stalls, counted)."""
    comms(late)
    cfg = from_dict({}, FIELD + FUSED + ["gradpool.max_buckets_in_flight=1"])
    model = build_sharded_model(cfg)
    pool = runtime_for(cfg.gradpool).pool
    seen = []
    release = type(pool).release

    def counting_release(self, lease, fence=None):
        release(self, lease, fence)
        seen.append(self.stats().fenced_buckets)

    monkeypatch.setattr(type(pool), "release", counting_release)
    _grad_fn(model)(make_batch(cfg.model, 0, seed=cfg.train.seed))
    assert max(seen) == 1
    assert pool.stats().stalls > 0
    assert all(u.async_stats.returned_in_flight == 1 for u in _non_root_units(model))
    for param, want in zip(model.trainable_params(), _reference_grads(cfg)):
        np.testing.assert_array_equal(param.main_grad.asnumpy(), want, err_msg=param.name)


def test_async_reduce_option_is_checked():
    with pytest.raises(InvalidArgumentError, match="GradPoolConfig.async_reduce"):
        GradPoolConfig(async_reduce="yes")
    assert from_dict({}, ["gradpool.async_reduce=false"]).gradpool.async_reduce is False
    assert GradPoolConfig().async_reduce is True


class _Leaf(ms.nn.Cell):
    def __init__(self, seed: int):
        super().__init__()
        values = np.random.default_rng(seed).standard_normal((3, 3)).astype(np.float32)
        self.w = ms.Parameter(ms.Tensor(values), name=f"w{seed}")

    def construct(self, x):
        return ms.mint.matmul(x, self.w)


class _NoOwnParams(ms.nn.Cell):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Leaf(1), _Leaf(2)

    def construct(self, x):
        return self.b(ms.mint.tanh(self.a(x)))


def test_a_root_without_parameters_overlaps_too(caplog):
    """No backward of the root's own ends the step: the end of autograd's backward pass does
    (its final callback), so the units leave their reduces in flight like any others and
    main_grad is final when value_and_grad returns."""
    from hyper_parallel import fully_shard
    from hyper_parallel.core.fully_shard.api import MixedPrecisionPolicy
    runtime_module.reset_runtimes()
    mp = MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
    x = ms.Tensor(np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3))
    ref = _NoOwnParams()
    _, want = ms.value_and_grad(lambda x: ref(x).sum(), None, ref.trainable_params())(x)
    model = _NoOwnParams()
    fully_shard(model.a, mp_policy=mp)
    fully_shard(model.b, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    with caplog.at_level("WARNING"):
        ms.value_and_grad(lambda x: model(x).sum(), None, model.trainable_params())(x)
    assert "synchronously" not in caplog.text
    units = [u for u in model._hsdp_units() if u.params]    # pylint: disable=protected-access
    assert [(u.async_stats.launched, u.async_stats.finished) for u in units] == [(1, 1)] * 2
    assert not RUNTIME.in_flight
    for param, expected in zip(model.trainable_params(), want):
        np.testing.assert_array_equal(param.main_grad.asnumpy(), expected.asnumpy())
    runtime_module.reset_runtimes()


def test_the_per_parameter_reduce_api_lands_an_in_flight_reduce_first(comms):
    """Upstream's per-parameter calls on a unit whose asynchronous reduce is still in flight:
    that reduce lands in main_grad first (not dropped), then the new one reduces."""
    comms(late)
    cfg = from_dict({}, FIELD)
    model = build_sharded_model(cfg)
    want = _reference_grads(cfg)
    model.set_is_last_backward(False)
    _grad_fn(model)(make_batch(cfg.model, 0, seed=cfg.train.seed))
    param = model.trainable_params()[0]
    managed = param.hsdp_param
    assert not np.any(param.main_grad.asnumpy()) and managed.unit in RUNTIME.in_flight
    extra = np.ones(managed.orig_shape, np.float32)
    managed.set_unsharded_grad(ms.Tensor(extra))
    managed.reduce_scatter_grad(async_op=False, reduce_op="sum")
    np.testing.assert_array_equal(param.main_grad.asnumpy(), want[0])   # the in-flight one
    np.testing.assert_array_equal(managed.reduce_scatter_output().asnumpy(), extra)
    managed.clear_reduce_scatter_output()
    model.set_is_last_backward(True)
    hsdp_sync_stream()


def test_a_failed_collective_left_in_flight_reaches_hsdp_sync_stream(comms):
    comms(lambda inner: FailNth(inner, 2))
    cfg = from_dict({}, FIELD + FUSED)
    model = build_sharded_model(cfg)
    pool = runtime_for(cfg.gradpool).pool
    batch = make_batch(cfg.model, 0, seed=cfg.train.seed)
    model.set_is_last_backward(False)
    _grad_fn(model)(batch)                       # returns: nothing was waited yet
    with pytest.raises(CommError, match="launch #2"):
        hsdp_sync_stream()
    assert not RUNTIME.in_flight
    stats = pool.stats()
    assert (stats.live_leases, stats.fenced_buckets) == (0, 0)
    model.zero_grad()
    model.set_is_last_backward(True)
    _grad_fn(model)(batch)
    for param, want in zip(model.trainable_params(), _reference_grads(cfg)):
        np.testing.assert_array_equal(param.main_grad.asnumpy(), want, err_msg=param.name)
