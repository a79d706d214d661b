"""gradpool.comm in one process: the single-process backend, fault injection, argument checks,
handle logic and backend choice (the multi-rank backends run in test_comm_distributed.py)."""
from __future__ import annotations

import time

import numpy as np
import pytest

import mindspore as ms
from mindspore import mint

from gradpool.comm import (AscendHcclCommunicator, CommHandle, CompletedHandle,
                           SingleProcessCommunicator, _WrappedHandle, communicator_for,
                           init_distributed)
from gradpool.dtypes import overwrite
from gradpool.errors import CommError, InvalidArgumentError, UnsupportedDtypeError
from gradpool.pool import BucketPool
from gradpool.testing import FaultInjectingCommunicator

DTYPES = [ms.float32, ms.float16, ms.bfloat16]
SENTINEL = -3.5


def values(numel: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(-32, 32, size=numel).astype(np.float32) * 0.25


def tensor(array: np.ndarray, dtype=ms.float32) -> ms.Tensor:
    return ms.Tensor(np.asarray(array, dtype=np.float32)).astype(dtype)


def read(t: ms.Tensor) -> np.ndarray:
    return np.array(t.astype(ms.float32).asnumpy())


@pytest.fixture
def comm():
    return SingleProcessCommunicator()


# -- SingleProcessCommunicator ---------------------------------------------------------------
def test_single_process_identity(comm):
    assert (comm.rank, comm.world_size) == (0, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_copies_input_into_prefix_view(comm, dtype, op):
    whole = tensor(np.full(50, SENTINEL), dtype)
    out = whole[0:37]
    src = values(37)
    handle = comm.reduce_scatter(out, tensor(src, dtype), op=op)
    assert isinstance(handle, CompletedHandle) and handle.is_completed()
    assert handle.wait() is None
    np.testing.assert_array_equal(read(whole)[:37], src)      # avg over one rank = identity
    np.testing.assert_array_equal(read(whole)[37:], SENTINEL)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather_copies_input(comm, dtype):
    out = mint.zeros(9, dtype=dtype)
    comm.all_gather(out, tensor(values(9, 1), dtype))
    np.testing.assert_array_equal(read(out), values(9, 1))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_all_reduce_leaves_tensor_as_is(comm, op):
    t = tensor(values(11))
    assert comm.all_reduce(t, op=op).is_completed()
    np.testing.assert_array_equal(read(t), values(11))


def test_same_tensor_as_output_and_input_is_fine(comm):
    t = tensor(values(8))
    comm.all_gather(t, t)
    comm.reduce_scatter(t, t)
    np.testing.assert_array_equal(read(t), values(8))


def test_writes_into_pool_lease(comm):
    pool = BucketPool(alignment_bytes=512)
    lease = pool.acquire(37, ms.bfloat16)
    assert not lease.is_whole_bucket
    comm.reduce_scatter(lease.tensor, tensor(values(37), ms.bfloat16))
    np.testing.assert_array_equal(read(lease.tensor), values(37))


def test_overwrite_casts_to_output_dtype():
    out = mint.zeros(4, dtype=ms.bfloat16)
    overwrite(out, tensor([1.0, 2.5, -3.0, 0.25], ms.float32))
    assert out.dtype == ms.bfloat16
    np.testing.assert_array_equal(read(out), [1.0, 2.5, -3.0, 0.25])


# -- argument checks ---------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["max", "mean", "SUM", None])
def test_bad_op_raises_naming_it(comm, op):
    t = mint.zeros(4, dtype=ms.float32)
    with pytest.raises(InvalidArgumentError, match=repr(op).replace("(", r"\(")):
        comm.reduce_scatter(mint.zeros(4, dtype=ms.float32), t, op=op)
    with pytest.raises(InvalidArgumentError, match="'sum', 'avg'"):
        comm.all_reduce(t, op=op)


def test_wrong_output_numel_names_expected_and_actual(comm):
    with pytest.raises(CommError, match=r"reduce_scatter output has 5 elements, expected 4"):
        comm.reduce_scatter(mint.zeros(5, dtype=ms.float32), mint.zeros(4, dtype=ms.float32))
    with pytest.raises(CommError, match=r"all_gather output has 3 elements, expected 4"):
        comm.all_gather(mint.zeros(3, dtype=ms.float32), mint.zeros(4, dtype=ms.float32))


def test_wrong_output_dtype_names_both(comm):
    with pytest.raises(CommError, match=r"output dtype Float16 does not match input dtype Float32"):
        comm.reduce_scatter(mint.zeros(4, dtype=ms.float16), mint.zeros(4, dtype=ms.float32))
    with pytest.raises(CommError, match=r"output dtype Int32"):
        comm.all_gather(mint.zeros(4, dtype=ms.int32), mint.zeros(4, dtype=ms.float32))


def test_non_flat_tensor_raises(comm):
    with pytest.raises(CommError, match=r"flat 1-D tensor, got shape \(2, 2\)"):
        comm.all_reduce(mint.zeros((2, 2), dtype=ms.float32))
    with pytest.raises(CommError, match="must be a mindspore Tensor, got ndarray"):
        comm.all_reduce(np.zeros(4, dtype=np.float32))


def test_unsupported_input_dtype_raises(comm):
    with pytest.raises(UnsupportedDtypeError, match="Int32"):
        comm.all_reduce(mint.zeros(4, dtype=ms.int32))


# -- FaultInjectingCommunicator ----------------------------------------------------------------
def test_delay_keeps_handle_incomplete_but_result_is_written(comm):
    faulty = FaultInjectingCommunicator(comm, delay_seconds=0.3)
    out = mint.zeros(6, dtype=ms.float32)
    start = time.monotonic()
    handle = faulty.all_gather(out, tensor(values(6)))
    assert isinstance(handle, CommHandle)
    assert handle.is_completed() is False
    np.testing.assert_array_equal(read(out), values(6))        # completion is what is delayed
    time.sleep(0.35)
    assert handle.is_completed() is True
    handle.wait()
    assert time.monotonic() - start >= 0.3


def test_wait_blocks_until_the_delay_has_passed(comm):
    faulty = FaultInjectingCommunicator(comm, delay_seconds=0.25)
    start = time.monotonic()
    handle = faulty.all_reduce(tensor(values(4)))
    handle.wait()
    assert time.monotonic() - start >= 0.25
    assert handle.is_completed()


def test_fail_wait_true_raises_comm_error_then_counts_as_completed(comm):
    faulty = FaultInjectingCommunicator(comm, delay_seconds=0.1, fail_wait=True)
    handle = faulty.reduce_scatter(mint.zeros(4, dtype=ms.float32), tensor(values(4)))
    assert not handle.is_completed()
    with pytest.raises(CommError, match="injected failure of reduce_scatter launch #1"):
        handle.wait()
    assert handle.is_completed()
    with pytest.raises(CommError):        # a failed collective stays failed
        handle.wait()


def test_fail_wait_raises_the_given_exception(comm):
    boom = TimeoutError("HCCL timed out")
    faulty = FaultInjectingCommunicator(comm, fail_wait=boom)
    handle = faulty.all_reduce(tensor(values(4)))
    with pytest.raises(TimeoutError) as info:
        handle.wait()
    assert info.value is boom
    assert handle.is_completed()


def test_launches_are_counted(comm):
    faulty = FaultInjectingCommunicator(comm)
    t = tensor(values(4))
    faulty.all_reduce(t)
    faulty.all_reduce(t, op="avg")
    faulty.all_gather(mint.zeros(4, dtype=ms.float32), t)
    assert faulty.launches == 3
    assert faulty.launch_counts == {"all_reduce": 2, "all_gather": 1}
    assert (faulty.rank, faulty.world_size) == (0, 1)


def test_fault_injector_checks_arguments_before_launching(comm):
    faulty = FaultInjectingCommunicator(comm)
    with pytest.raises(CommError):
        faulty.reduce_scatter(mint.zeros(3, dtype=ms.float32), mint.zeros(4, dtype=ms.float32))
    assert faulty.launches == 0


@pytest.mark.parametrize("kwargs", [{"delay_seconds": -1}, {"delay_seconds": "1"},
                                    {"fail_wait": "yes"}, {"fail_wait": CommError}])
def test_fault_injector_rejects_bad_settings(comm, kwargs):
    with pytest.raises(InvalidArgumentError):
        FaultInjectingCommunicator(comm, **kwargs)


def test_delayed_handle_fences_a_pool_bucket(comm):
    """The handle is a pool fence: the bucket is not reused before the delay has passed."""
    pool = BucketPool()
    faulty = FaultInjectingCommunicator(comm, delay_seconds=0.3)
    lease = pool.acquire(64, ms.float32)
    handle = faulty.all_reduce(lease.tensor)
    lease.release(handle)
    assert pool.stats().fenced_buckets == 1
    second = pool.acquire(64, ms.float32)        # fenced: a new bucket
    assert pool.stats().new_allocations == 2
    second.release()
    time.sleep(0.35)
    assert pool.stats().fenced_buckets == 0


# -- the Ascend handle wrapper, with stand-ins for MindSpore's handle --------------------------
class FakeMsHandle:
    """Like MindSpore 2.10's CommHandle: wait() only."""

    def __init__(self, error=None):
        self.waits = 0
        self.error = error

    def wait(self):
        self.waits += 1
        if self.error:
            raise self.error


def test_wrapped_handle_without_native_query_is_incomplete_until_waited():
    after = []
    handle = _WrappedHandle(FakeMsHandle(), "all_reduce", after=lambda: after.append(1))
    assert not handle.is_completed()
    handle.wait()
    handle.wait()
    assert handle.is_completed() and after == [1]


def test_wrapped_handle_uses_a_native_is_completed():
    inner = FakeMsHandle()
    inner.is_completed = lambda: True
    after = []
    handle = _WrappedHandle(inner, "all_reduce", after=lambda: after.append(1))
    assert handle.is_completed() and after == [1]


def test_wrapped_handle_reraises_failure_as_comm_error():
    handle = _WrappedHandle(FakeMsHandle(RuntimeError("HCCL error 7")), "reduce_scatter on rank 3")
    for _ in range(2):
        with pytest.raises(CommError, match="reduce_scatter on rank 3 failed.*HCCL error 7"):
            handle.wait()
    with pytest.raises(CommError, match="HCCL error 7"):
        handle.is_completed()      # a failed collective never reads as completed


class FakeDist:
    """Stands in for mindspore.mint.distributed on a 2-rank group whose other rank sent zeros."""

    def __init__(self):
        self.calls = []

    def get_rank(self, group=None):
        return 0

    def get_world_size(self, group=None):
        return 2

    def reduce_scatter_tensor(self, output, input, op="sum", group=None, async_op=False):
        self.calls.append(("reduce_scatter_tensor", op, group, async_op))
        overwrite(output, input[0:output.numel()])
        return FakeMsHandle() if async_op else None

    def all_reduce(self, tensor, op="sum", group=None, async_op=False):
        self.calls.append(("all_reduce", op, group, async_op))
        return FakeMsHandle() if async_op else None


def test_ascend_communicator_refuses_cpu():
    with pytest.raises(CommError, match="needs device target 'Ascend'.*'CPU'"):
        AscendHcclCommunicator()


def test_ascend_communicator_passes_avg_to_hccl():
    dist = FakeDist()
    comm = AscendHcclCommunicator(group="g", backend=dist)
    handle = comm.reduce_scatter(mint.zeros(2, dtype=ms.float32), tensor([1, 2, 3, 4]), op="avg",
                                 async_op=True)
    assert dist.calls == [("reduce_scatter_tensor", "avg", "g", True)]
    assert not handle.is_completed()
    handle.wait()
    assert handle.is_completed()


@pytest.mark.parametrize("async_op", [True, False])
def test_ascend_avg_fallback_divides_after_the_wait(async_op):
    dist = FakeDist()
    comm = AscendHcclCommunicator(backend=dist)
    comm.native_avg = False
    out = mint.zeros(2, dtype=ms.bfloat16)
    handle = comm.reduce_scatter(out, tensor([4, 6, 0, 0], ms.bfloat16), op="avg",
                                 async_op=async_op)
    assert dist.calls[0][1] == "sum"
    handle.wait()
    np.testing.assert_array_equal(read(out), [2, 3])


# -- choosing a backend ------------------------------------------------------------------------
def test_outside_msrun_is_single_process(monkeypatch):
    for name in ("MS_ROLE", "MS_WORKER_NUM", "MS_SCHED_HOST"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() == (0, 1)
    assert isinstance(communicator_for(), SingleProcessCommunicator)
    assert isinstance(communicator_for(device="Ascend"), SingleProcessCommunicator)


def test_unknown_device_raises():
    with pytest.raises(InvalidArgumentError, match="device 'GPU' is not supported"):
        communicator_for(device="GPU")


@pytest.mark.parametrize("numel, limit", [(1, 8), (8, 8), (9, 8), (37, 8), (100, 16), (5, 1)])
def test_cpu_pieces_cover_the_tensor_in_order_each_padded_to_a_power_of_two(numel, limit):
    from gradpool.comm import cpu_pieces
    pieces = cpu_pieces(numel, limit)
    covered = [i for start, length, _ in pieces for i in range(start, start + length)]
    assert covered == list(range(numel))
    for start, length, padded in pieces:
        assert 0 < length <= limit and length <= padded < 2 * length
        assert padded & (padded - 1) == 0


@pytest.mark.parametrize("target, drains", [("CPU", 1), ("Ascend", 0)])
def test_a_single_process_copy_waits_for_the_device_only_off_ascend(monkeypatch, target, drains):
    """A copy not made through host memory (device tensors: stood in for by refusing the host
    copy) is queued with ops; the host waits for it only off Ascend, where the host path reads
    the output next (on Ascend its readers are queued after it on the stream). The output holds
    the input either way."""
    import gradpool.comm as comm_module
    waits = []
    real = comm_module.synchronize
    monkeypatch.setattr(comm_module, "synchronize", lambda: waits.append(1) or real())
    monkeypatch.setattr(comm_module, "device_target", lambda: target)
    monkeypatch.setattr(comm_module, "_host_copy", lambda output, input: False)
    source = np.arange(6, dtype=np.float32) - 2.5
    output = mint.zeros(6, dtype=ms.float32)
    handle = SingleProcessCommunicator().all_gather(output, ms.Tensor(source))
    assert handle.is_completed() and len(waits) == drains
    np.testing.assert_array_equal(output.asnumpy(), source)
