"""gradpool.device: waiting for MindSpore's PyNative queue on CPU.

The host paths read and write tensor memory with NumPy and compiled loops, which MindSpore's
queue knows nothing about: ``drain_launch_queue`` must not return before an op queued earlier has
written its output. These tests queue a slow op (a 1,024 x 1,024 matmul, tens of milliseconds on
CPU) whose result lands in a tensor through a queued ``copy_``, and read that tensor's memory
through a NumPy alias taken beforehand, which waits for nothing itself.
"""
from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import mint

from gradpool.device import drain_launch_queue, synchronize
from gradpool.dtypes import host_alias

ms.set_device("CPU")

ROUNDS = 8


def _queued_writes(wait) -> tuple[int, int]:
    """How many of ROUNDS queued results the alias showed after ``wait()``, and how many it
    showed with no wait at all (the test's own control: the queue really was still running)."""
    rng = np.random.default_rng(5)
    a = ms.Tensor(rng.standard_normal((1024, 1024)).astype(np.float32))
    out = mint.zeros(1024, dtype=ms.float32)
    alias = host_alias(out)                       # the tensor's memory, read with no wait
    offsets = [ms.Tensor(np.full(1024, k, np.float32)) for k in range(2 * ROUNDS)]
    mint.matmul(a, a).asnumpy()                   # first-call costs outside the rounds
    seen = {"waited": 0, "unwaited": 0}
    for k in range(2 * ROUNDS):
        waited = k % 2 == 0
        result = mint.add(mint.sum(mint.matmul(a, a), dim=0), offsets[k])
        out.copy_(result)
        if waited:
            wait()
        got = alias.copy()
        want = result.asnumpy()                   # waits for everything queued
        seen["waited" if waited else "unwaited"] += int(np.array_equal(got, want))
    return seen["waited"], seen["unwaited"]


def test_drain_returns_only_after_every_queued_op_has_written_its_output():
    waited, unwaited = _queued_writes(drain_launch_queue)
    assert waited == ROUNDS
    # Without a wait the queued matmul had not finished in most rounds: the check can fail.
    assert unwaited < ROUNDS


def test_synchronize_on_cpu_waits_as_the_drain_does():
    waited, _ = _queued_writes(synchronize)
    assert waited == ROUNDS


def test_without_mindspore_s_pipeline_wait_the_drain_is_the_executor_s_sync(monkeypatch):
    """A MindSpore release without ``_c_expression._wait_pipeline``: the drain falls back to the
    PyNative executor's sync, which waits as well."""
    import mindspore._c_expression as c_expression
    from mindspore.graph.api import _pynative_executor

    from gradpool import device
    monkeypatch.delattr(c_expression, "_wait_pipeline")
    device._pipeline_wait.cache_clear()
    try:
        assert device._pipeline_wait() == _pynative_executor._executor.sync
        waited, _ = _queued_writes(device.drain_launch_queue)
        assert waited == ROUNDS
    finally:
        device._pipeline_wait.cache_clear()
    monkeypatch.undo()
    assert device._pipeline_wait() is c_expression._wait_pipeline
