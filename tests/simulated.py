"""In-process stand-ins for what the pool and the reducer talk to, shared by the module tests: a
second rank (:class:`PeerScaled`), fences a test completes by hand (:class:`ManualFence`) or that
have ``wait()`` only (:class:`WaitOnlyHandle`), and the reducer and random gradients the tests
build on them."""
from __future__ import annotations

import mindspore as ms
import numpy as np

from gradpool.comm import CompletedHandle, Communicator, SingleProcessCommunicator
from gradpool.dtypes import overwrite
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig
from npref import normal


class ManualFence:
    """A fence the test completes by hand (a collective still in flight): not completed until
    waited; wait() completes it and counts the call."""

    def __init__(self):
        self.done = False
        self.waits = 0

    def is_completed(self):
        return self.done

    def wait(self):
        self.waits += 1
        self.done = True


class WaitOnlyHandle:
    """Like MindSpore 2.10's CommHandle: wait() and nothing else."""

    def __init__(self):
        self.waits = 0

    def wait(self):
        self.waits += 1


class PeerScaled(Communicator):
    """Rank 0 of a 2-rank group whose peer sends ``peer_scale`` times what this rank sends, so a
    sum is (1 + peer_scale) x and an avg half that; with peer_scale=3 both are powers of two,
    exact in every dtype. ``fail_at``: the 1-based launch that raises; ``pending``: handles stay
    not-completed until waited (a collective in flight)."""

    def __init__(self, peer_scale=3.0, fail_at=None, pending=False):
        self.peer_scale, self.fail_at, self.pending = peer_scale, fail_at, pending
        self.launched = 0
        self.async_ops = []

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 2

    def _factor(self, op):
        total = 1.0 + self.peer_scale
        return total / 2 if op == "avg" else total

    def _write(self, out, values, async_op):
        self.async_ops.append(async_op)
        self.launched += 1
        if self.launched == self.fail_at:
            raise RuntimeError(f"launch {self.launched} failed")
        overwrite(out, ms.Tensor(values).astype(out.dtype))
        return ManualFence() if self.pending else CompletedHandle()

    def _reduce_scatter(self, output, input, op, async_op):
        own_chunk = input.astype(ms.float32).asnumpy()[:output.numel()]
        return self._write(output, own_chunk * self._factor(op), async_op)

    def _all_reduce(self, tensor, op, async_op):
        return self._write(tensor, tensor.astype(ms.float32).asnumpy() * self._factor(op),
                           async_op)

    def _all_gather(self, output, input, async_op):
        raise NotImplementedError("not needed by these tests")


def make_reducer(comm=None, replicate=None, **config):
    """A float32 reducer on a fresh CPU pool, over ``comm`` (one process by default)."""
    pool = BucketPool(device="CPU", alignment_bytes=4)
    return GradReducer(pool, comm if comm is not None else SingleProcessCommunicator(),
                       ReducerConfig(reduce_dtype=ms.float32, **config), replicate_comm=replicate)


def random_grads(shapes, seed):
    """Seeded standard-normal float32 gradients: the NumPy arrays and their tensors."""
    rng = np.random.default_rng(seed)
    raw = [normal(rng, s) for s in shapes]
    return raw, [ms.Tensor(r) for r in raw]
