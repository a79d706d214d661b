"""What the tests that put the pool and the reducer through what a demanding user does (Ctrl-C at
any instant, a monitoring thread, sizes the allocator refuses) check afterwards: the pool holds
exactly the bytes it says, no lease is live that nobody holds, and the next reduce gives NumPy's
values. And the timer that raises the Ctrl-C."""
import signal

import numpy as np

from simulated import random_grads

STEP_SHAPES = [(7, 3), (5,), (4, 6)]


def step_grads(seed):
    """The gradients of one step: seeded random values of :data:`STEP_SHAPES`."""
    return random_grads(STEP_SHAPES, seed)


def real_bytes(pool):
    """What the pool's bucket records really hold (white-box: the invariant under test)."""
    return sum(b.tensor.untyped_storage().size() for b in pool._buckets)


def assert_consistent(pool, held=0):
    stats = pool.stats()
    assert stats.bytes_reserved == real_bytes(pool)
    assert stats.high_water_bytes >= stats.bytes_reserved
    assert stats.live_leases == held
    assert stats.live_leases + stats.fenced_buckets + stats.free_buckets \
        + stats.quarantined_buckets == len(pool._buckets)


class QuarantineWatch:
    """Remembers every bucket record the pool ever quarantined (white-box: the promise under
    test) and checks that none of them came back: each is still quarantined, its memory held,
    until a trim() on the pool's thread stops tracking it (after a device synchronize: the
    tests that patch the synchronize check that order)."""

    def __init__(self, pool):
        self.pool = pool
        self.seen: list = []

    def check(self):
        for bucket in self.pool._buckets:
            if bucket.state == "quarantined" and all(bucket is not b for b in self.seen):
                self.seen.append(bucket)
        for bucket in self.seen:
            if any(bucket is b for b in self.pool._buckets):
                assert bucket.state == "quarantined" and bucket.lease is None, bucket
                assert bucket.tensor.untyped_storage().size() == bucket.nbytes, bucket
        return len(self.seen)


def assert_reduces_correctly(reducer, seed=99):
    arrays, tensors = step_grads(seed)
    result = reducer.reduce_scatter(tensors, op="sum")
    try:
        for shard, want in zip(result.wait(), arrays):
            np.testing.assert_array_equal(shard.asnumpy(), want)
    finally:
        result.release()


class Interrupt:
    """Raises KeyboardInterrupt in the main thread after a random delay (one shot)."""

    def __init__(self):
        self._old = signal.signal(signal.SIGALRM, self._fire)

    @staticmethod
    def _fire(signum, frame):
        raise KeyboardInterrupt

    def arm(self, seconds):
        signal.setitimer(signal.ITIMER_REAL, seconds)

    def disarm(self):
        signal.setitimer(signal.ITIMER_REAL, 0)

    def close(self):
        self.disarm()
        signal.signal(signal.SIGALRM, self._old)
