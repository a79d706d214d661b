"""The device-event fence of the fused all-gather's bucket (gradpool.device.EventFence,
fence_queued_work) against the pool's Fence contract, on CPU with a stand-in event: MindSpore's
``Event`` serves Ascend only, so what is tested here is what the pool does with the event's
answers, and the device-target guard that picks the event."""
import mindspore as ms
import pytest

import gradpool.device as device
from gradpool import BucketPool, EventFence, fence_queued_work

NUMEL = 1000


class FakeEvent:
    """An event whose ``query()`` answers what the test says; counts its calls."""

    def __init__(self, done: bool = False):
        self.done = done
        self.recorded = 0
        self.synchronized = 0
        self.query_error = None

    def record(self, stream=None):
        self.recorded += 1

    def query(self) -> bool:
        if self.query_error is not None:
            raise self.query_error
        return self.done

    def synchronize(self) -> None:
        self.synchronized += 1
        self.done = True


def _address(lease) -> int:
    return lease.allocation.untyped_storage().data_ptr()


def test_the_pool_leases_the_bucket_only_once_the_event_is_reached():
    pool = BucketPool(device="CPU")
    event = FakeEvent()
    first = pool.acquire(NUMEL, ms.float32)
    fenced = _address(first)
    first.release(EventFence(event))
    assert pool.stats().fenced_buckets == 1
    other = pool.acquire(NUMEL, ms.float32)       # query() False: another bucket
    assert _address(other) != fenced and event.synchronized == 0
    other.release()
    event.done = True
    again = [pool.acquire(NUMEL, ms.float32) for _ in range(2)]
    assert fenced in {_address(lease) for lease in again}
    assert event.synchronized == 0, "a reached event needs no host wait"
    for lease in again:
        lease.release()


def test_the_pool_waits_on_the_event_only_when_it_must_reuse_that_bucket():
    pool = BucketPool(device="CPU", max_buckets_in_flight=1)
    event = FakeEvent()
    first = pool.acquire(NUMEL, ms.float32)
    fenced = _address(first)
    first.release(EventFence(event))
    second = pool.acquire(NUMEL, ms.float32)      # at the cap: waits for the oldest fence
    assert event.synchronized == 1 and _address(second) == fenced
    assert pool.stats().stalls == 1
    second.release()


def test_a_raising_query_quarantines_the_bucket():
    pool = BucketPool(device="CPU")
    event = FakeEvent()
    event.query_error = RuntimeError("device event failed")
    lease = pool.acquire(NUMEL, ms.float32)
    bad = _address(lease)
    lease.release(EventFence(event))              # queried at release: raises, quarantined
    stats = pool.stats()
    assert stats.quarantined_buckets == 1 and stats.failed_fences == 1
    event.query_error = None
    event.done = True
    fresh = pool.acquire(NUMEL, ms.float32)
    assert _address(fresh) != bad, "a quarantined bucket is never leased again"
    fresh.release()


def test_a_query_raising_later_quarantines_the_fenced_bucket():
    pool = BucketPool(device="CPU")
    event = FakeEvent()
    lease = pool.acquire(NUMEL, ms.float32)
    lease.release(EventFence(event))              # fenced: query() False
    event.query_error = RuntimeError("device event failed")
    assert pool.stats().quarantined_buckets == 1


def test_on_ascend_the_fence_is_an_event_recorded_with_no_host_wait(monkeypatch):
    made = []

    def event_factory(*args, **kwargs):
        made.append(FakeEvent())
        return made[-1]

    monkeypatch.setattr(device, "device_target", lambda: "Ascend")
    monkeypatch.setattr(ms.runtime, "Event", event_factory)
    waits = []
    monkeypatch.setattr(ms.runtime, "synchronize", lambda: waits.append(1))
    fence = fence_queued_work()
    assert isinstance(fence, EventFence) and fence.event is made[0]
    assert made[0].recorded == 1 and waits == [] and made[0].synchronized == 0
    assert fence.is_completed() is False
    made[0].done = True
    assert fence.is_completed() is True


def test_off_ascend_the_queued_work_is_waited_for_and_no_fence_is_made(monkeypatch):
    waits = []
    real = device.synchronize
    monkeypatch.setattr(device, "synchronize", lambda: waits.append(1) or real())
    events = []
    monkeypatch.setattr(ms.runtime, "Event", lambda *a, **k: events.append(1))
    assert device.device_target() == "CPU"
    assert fence_queued_work() is None
    assert waits == [1] and events == []


@pytest.mark.parametrize("done", [False, True])
def test_the_fence_answers_the_event(done):
    fence = EventFence(FakeEvent(done))
    assert fence.is_completed() is done
    fence.wait()
    assert fence.event.synchronized == 1 and fence.is_completed()
