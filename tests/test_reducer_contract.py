"""The reducer's two-step API (pack, accumulate, launch, release) held to its contract: the
defaults it documents, the errors it raises (exact text: users read them), what it gives back
and when, every collective launched asynchronously. Written against the mutants of
``make mutation`` the rest of the suite let live. A second rank is simulated in-process
(``simulated.PeerScaled``; the same behaviours run on 2 real msrun ranks in
``reducer_cases.py``)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from gradpool.errors import ArgumentTypeError, InvalidArgumentError, LayoutMismatchError, \
    LeaseStateError
from gradpool.reducer import GradReducer, ReducerConfig
from npref import values
from simulated import ManualFence, PeerScaled, make_reducer, random_grads

ms.set_device("CPU")


# -- config --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["comm_fusion", "zero_copy", "host_copies"])
def test_a_non_bool_switch_is_refused_naming_the_config_field(name):
    with pytest.raises(ArgumentTypeError) as err:
        ReducerConfig(**{name: 1})
    assert str(err.value) == f"ReducerConfig.{name} must be a bool (True or False), got int 1"


def test_a_bucket_cap_that_is_not_positive_is_refused_naming_the_field():
    with pytest.raises(InvalidArgumentError) as err:
        ReducerConfig(bucket_cap_mib=0)
    assert str(err.value) == "ReducerConfig.bucket_cap_mib must be a finite number > 0, got 0"


# -- pack and accumulate ---------------------------------------------------------------------------
def test_pack_uses_the_world_size_it_is_given():
    """The shard group has 2 ranks; packing for a world of 1 (an all-reduce) lays out whole
    gradients, and a wrong shard_dims length is refused by name."""
    raw, grads = random_grads([(4, 3), (5,)], 51)
    reducer = make_reducer(PeerScaled())
    packed = reducer.pack(grads, world_size=1)
    assert [b.layout.world_size for b in packed] == [1, 1]
    reducer.discard(packed)
    assert [b.layout.world_size for b in reducer.pack(grads)] == [2, 2]
    with pytest.raises(InvalidArgumentError) as err:
        reducer.pack(grads, shard_dims=[0])
    assert str(err.value) == "shard_dims has 1 entries for 2 gradients; give one each"
    assert reducer.pool.stats().live_leases == 2      # the two of the second pack, untouched


def test_accumulate_errors_say_what_was_wrong_and_change_nothing():
    raw, grads = random_grads([(4, 3), (6,)], 52)
    reducer = make_reducer(PeerScaled(), zero_copy=True)
    packed = reducer.pack(grads, allow_borrow=False)
    before = [values(b.lease.tensor).copy() for b in packed]
    with pytest.raises(InvalidArgumentError) as err:
        reducer.accumulate(packed, grads[:1])
    assert str(err.value) == ("accumulate got 1 gradients for buckets packed from 2; pass the "
                              "micro-step's gradients of exactly the packed parameters, in order")
    wrong_shape = [grads[0], ms.Tensor(np.zeros((5,), np.float32))]
    with pytest.raises(LayoutMismatchError) as err:
        reducer.accumulate(packed, wrong_shape)
    assert str(err.value) == "gradient 1 has shape (5,); it was packed as (6,)"
    for bucket, old in zip(packed, before):
        np.testing.assert_array_equal(values(bucket.lease.tensor), old)
    reducer.discard(packed)
    borrowed = reducer.pack(grads[1:])
    assert borrowed[0].borrowed is not None
    with pytest.raises(LeaseStateError) as err:
        reducer.accumulate(borrowed, grads[1:])
    assert str(err.value) == ("cannot accumulate into a borrowed gradient; pack with "
                              "allow_borrow=False for gradient accumulation")
    reducer.discard(borrowed)


def test_borrows_count_each_borrowed_gradient_from_zero():
    raw, grads = random_grads([(8,), (6,)], 53)
    reducer = make_reducer(PeerScaled(), zero_copy=True)
    assert reducer.borrows == 0
    packed = reducer.pack(grads)
    assert reducer.borrows == 2 and all(b.borrowed is not None for b in packed)
    reducer.discard(packed)
    reducer.discard(reducer.pack(grads[:1]))
    assert reducer.borrows == 3


# -- launch --------------------------------------------------------------------------------------
def test_launch_averages_by_default_and_reports_the_count_it_is_given():
    """launch() defaults to avg (the peer sends 3x: avg is 2x); ``count`` sizes the result for
    a caller whose buckets hold only some of its gradients (positions by index)."""
    raw, grads = random_grads([(4, 3), (6,)], 54)
    reducer = make_reducer(PeerScaled())
    result = reducer.launch(reducer.pack(grads), count=3)
    shards = result.wait()
    assert len(shards) == 3 and shards[2] is None
    for shard, full in zip(shards, raw):
        np.testing.assert_array_equal(values(shard).reshape(-1),
                                      2.0 * full.reshape(2, -1)[0])
    result.release()
    assert reducer.comm.async_ops == [True, True]


def test_launch_all_reduce_reduces_whole_buckets_in_place():
    raw, grads = random_grads([(4, 3), (5,)], 55)
    reducer = make_reducer(PeerScaled())
    packed = reducer.pack(grads, world_size=1, allow_borrow=False)
    result = reducer.launch(packed, op="sum", all_reduce=True)
    for reduced, full in zip(result.wait(), raw):
        np.testing.assert_array_equal(values(reduced).reshape(full.shape), 4.0 * full)
    assert [item.output for item in result.launched] == [b.lease for b in packed]
    result.release()
    assert reducer.pool.stats().live_leases == 0


def test_launch_all_reduces_across_replicas_by_default_asynchronously():
    """HSDP through the two-step API: a 2-rank shard group and a 2-rank replicate group. By
    default each reduce-scatter's output is all-reduced across the replicas too (avg: 2x per
    group, 4x in all), each collective launched with async_op=True; across_replicas=False
    stops after the reduce-scatter."""
    raw, grads = random_grads([(4, 3), (6,)], 56)
    replicas = PeerScaled()
    reducer = make_reducer(PeerScaled(), replicate=replicas)
    for kwargs, factor in ((dict(), 2.0 * 2.0), (dict(across_replicas=False), 2.0)):
        result = reducer.launch(reducer.pack(grads), **kwargs)
        for shard, full in zip(result.wait(), raw):
            np.testing.assert_array_equal(values(shard).reshape(-1),
                                          factor * full.reshape(2, -1)[0])
        result.release()
    assert reducer.comm.async_ops == [True] * 4
    assert replicas.async_ops == [True] * 2


def test_replicas_all_reduce_whole_shards_whatever_the_shard_group_size():
    """all_reduce_replicas reduces shard gradients as they are (a world of 1), even when the
    shard group has 2 ranks."""
    raw, grads = random_grads([(3, 2), (5,)], 57)
    replicas = PeerScaled()
    reducer = make_reducer(PeerScaled(), replicate=replicas)
    result = reducer.all_reduce_replicas(grads)
    for reduced, full in zip(result.wait(), raw):
        np.testing.assert_array_equal(values(reduced).reshape(full.shape), 2.0 * full)
    result.release()
    assert reducer.comm.launched == 0 and replicas.async_ops == [True, True]


def test_launching_a_discarded_bucket_is_refused_and_gives_back_the_rest():
    raw, grads = random_grads([(4,), (6,)], 58)
    reducer = make_reducer(PeerScaled())
    first, second = reducer.pack(grads)
    reducer.discard([second])
    with pytest.raises(LeaseStateError) as err:
        reducer.launch([first, second])
    assert str(err.value) == ("a bucket handed to launch() was launched or discarded already; "
                              "pack anew")
    assert first.lease.released and reducer.pool.stats().live_leases == 0
    assert reducer.comm.launched == 0


def test_a_failed_launch_ends_every_borrow():
    raw, grads = random_grads([(4,), (6,)], 59)
    reducer = make_reducer(PeerScaled(fail_at=1), zero_copy=True)
    packed = reducer.pack(grads)
    with pytest.raises(RuntimeError, match="launch 1 failed"):
        reducer.launch(packed)
    assert [b.borrowed for b in packed] == [None, None]
    assert reducer.pool.stats().live_leases == 0


# -- results -------------------------------------------------------------------------------------
def test_a_released_result_ends_its_borrows_and_cannot_be_waited(caplog):
    """A borrowed gradient's collective completed, the result released unwaited: released
    plainly (nothing left to fence, so no fence wraps a missing handle), the borrow dropped;
    wait() then says why it cannot."""
    raw, grads = random_grads([(8,)], 60)
    reducer = make_reducer(PeerScaled(), zero_copy=True)
    packed = reducer.pack(grads)
    result = reducer.launch(packed)
    with caplog.at_level("WARNING"):
        result.release()
    assert caplog.records == []
    assert packed[0].borrowed is None
    stats = reducer.pool.stats()
    assert (stats.live_leases, stats.fenced_buckets) == (0, 0)
    with pytest.raises(LeaseStateError) as err:
        result.wait()
    assert str(err.value) == "this reduce result was released; its shard views are gone"


def test_an_interrupted_release_gives_back_every_bucket_and_logs_a_second_failure(
        monkeypatch, caplog):
    """The first output release is interrupted (Ctrl-C), and releasing it again during the
    clean-up fails too: every other output still goes back, the failure is logged, the interrupt
    goes on, and a second release() finishes the job."""
    raw, grads = random_grads([(4,), (6,), (2,)], 61)
    reducer = make_reducer(PeerScaled())
    result = reducer.reduce_scatter(grads)
    result.wait()
    pool = reducer.pool
    real_release = type(pool).release
    failures = [KeyboardInterrupt(), RuntimeError("device busy")]

    def flaky_release(self, lease, fence=None):
        if failures:
            raise failures.pop(0)
        return real_release(self, lease, fence)
    monkeypatch.setattr(type(pool), "release", flaky_release)
    with caplog.at_level("ERROR", logger="gradpool.reducer"), pytest.raises(KeyboardInterrupt):
        result.release()
    assert [r.getMessage() for r in caplog.records] == \
        ["releasing an output bucket after an error failed"]
    assert pool.stats().live_leases == 1          # only the one whose release failed twice
    result.release()
    assert pool.stats().live_leases == 0


def test_a_chain_is_completed_only_when_both_collectives_are():
    from gradpool.comm import CompletedHandle
    from gradpool.reducer import _Chain
    pending = ManualFence()
    assert _Chain(CompletedHandle(), pending).is_completed() is False
    assert _Chain(pending, CompletedHandle()).is_completed() is False
    assert _Chain(CompletedHandle(), CompletedHandle()).is_completed() is True


# -- copies ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("host_copies, timed, syncs_per_copy",
                         [(True, True, 1), (False, True, 2), (True, False, 0), (False, False, 0)])
def test_the_config_chooses_the_copy_path_and_a_timed_device_copy_is_waited_for(
        monkeypatch, host_copies, timed, syncs_per_copy):
    """``host_copies`` chooses the writer every pack and accumulate goes through (the host
    writer, else the device one); with timed copies a device copy is bracketed by two
    synchronizes (the clock measures the copy, not queued work), a host copy follows one (NumPy
    writes are done on return); untimed copies wait for nothing."""
    import types
    from gradpool import reducer as reducer_module
    from gradpool.comm import SingleProcessCommunicator
    from gradpool.host.writer import HostWriter
    from gradpool.pool import BucketPool
    hosts, syncs = [], []
    monkeypatch.setattr(reducer_module, "synchronize", lambda: syncs.append(1))
    pool = BucketPool(device="CPU", alignment_bytes=4, timed_copies=timed)
    reducer = GradReducer(pool, SingleProcessCommunicator(),
                          ReducerConfig(reduce_dtype=ms.float32, host_copies=host_copies))
    chosen = reducer.writer

    def spy(name):
        def call(*args, **kwargs):
            hosts.append(isinstance(chosen, HostWriter))
            return getattr(chosen, name)(*args, **kwargs)
        return call
    monkeypatch.setattr(reducer, "writer", types.SimpleNamespace(
        pack=spy("pack"), accumulate=spy("accumulate")))
    raw, grads = random_grads([(4,)], 62)
    packed = reducer.pack(grads)
    reducer.accumulate(packed, grads)
    assert hosts == [host_copies, host_copies]
    assert len(syncs) == 2 * syncs_per_copy
    np.testing.assert_array_equal(values(packed[0].lease.tensor), 2 * raw[0])
    reducer.discard(packed)
