"""The device target, its memory size, and waiting for queued work on it (PyNative launches ops
asynchronously). MindSpore is imported on first use, so the device list costs nothing to read
(the benchmark report and the config loader need only that)."""
from __future__ import annotations

import contextlib
import functools
import logging
import os

logger = logging.getLogger(__name__)

SUPPORTED_DEVICES = ("CPU", "Ascend")
# An Ascend 910B card's HBM (64 GB): no bucket can be larger than the card.
ASCEND_910B_HBM_BYTES = 64 * 2 ** 30


def device_memory_bytes(device: str) -> int:
    """The most memory one allocation on ``device`` could ever get: the host's physical memory on
    CPU, the card's HBM on Ascend."""
    if device == "Ascend":
        return ASCEND_910B_HBM_BYTES
    return _host_memory_bytes()


@functools.lru_cache(maxsize=1)
def _host_memory_bytes() -> int:
    # Read once: the pool asks on every acquire, and sysconf(SC_PHYS_PAGES) is a system call.
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_target() -> str:
    """The context's device target ("CPU", "Ascend"), read afresh on every call (``set_context``
    may still change it), straight from the context object where MindSpore has one: ``get_context``
    validates every option first, and ``synchronize`` asks per collective and per timed pack
    (docs/benchmarks/host-path.md#reading-the-device-target)."""
    reader = _target_reader()
    if reader is not None:
        return reader()
    import mindspore as ms
    return ms.get_context("device_target")


@functools.lru_cache(maxsize=1)
def _target_reader():
    # Cached is the reader, not the target: the same context parameter get_context returns.
    try:
        from mindspore.context import _context, ms_ctx_param
        context, key = _context(), ms_ctx_param.device_target
    except (ImportError, AttributeError):
        logger.debug("MindSpore has no context parameter reader; using get_context")
        return None
    return functools.partial(context.get_param, key)


META_DEVICE = "meta"


def real_device_target() -> str:
    """The device real work runs on: :func:`device_target`, or, while ``ms.DeviceCtx("meta")``
    is active (a model built without memory, as mindformers' Trainer does), the device that
    context replaced. Pools, communicators and buffers are built there whatever context is
    active: a bucket on the meta device has no memory to communicate through."""
    target = device_target()
    if target != META_DEVICE:
        return target
    return _device_under_meta()[0]


def _device_under_meta() -> tuple[str, int]:
    # DeviceCtx keeps, per thread, the device each active context replaced: the newest one
    # that is not meta is where this thread's real work goes.
    try:
        from mindspore.common.device import _DEVICE_STACK
        saved = list(_DEVICE_STACK.get_stack())
    except (ImportError, AttributeError):     # another MindSpore release
        saved = []
    for info in reversed(saved):
        if info.device_target != META_DEVICE:
            return info.device_target, info.device_id
    from gradpool.errors import InvalidArgumentError
    raise InvalidArgumentError(
        "the meta device is the process's device (no ms.DeviceCtx replaced a real one), so "
        "there is no device to build communication memory on; call ms.set_device('CPU' or "
        "'Ascend') and enter ms.DeviceCtx('meta') only around model construction")


@contextlib.contextmanager
def on_real_device():
    """Run the block on :func:`real_device_target` (a no-op unless the meta device is active)."""
    if device_target() != META_DEVICE:
        yield
        return
    import mindspore as ms
    target, device_id = _device_under_meta()
    with ms.DeviceCtx(target, device_id):
        yield


def synchronize() -> None:
    """Block until every op launched so far has run. ``ms.runtime.synchronize`` serves Ascend
    only (on CPU it logs "CPU device is not supported"): CPU drains PyNative's launch queue."""
    if device_target() == "Ascend":
        import mindspore as ms
        ms.runtime.synchronize()
    else:
        drain_launch_queue()


class EventFence:
    """A pool fence (``gradpool.pool.Fence``) on a device event recorded after queued work:
    completed once the device has run everything queued before the event (``query()``, no host
    wait); ``wait()`` blocks the host on that event alone (``synchronize()``), which the pool
    does only when it must reuse the bucket behind it."""

    __slots__ = ("event",)

    def __init__(self, event):
        self.event = event

    def is_completed(self) -> bool:
        return bool(self.event.query())

    def wait(self) -> None:
        self.event.synchronize()

    def __repr__(self) -> str:
        return f"EventFence({self.event!r})"


def fence_queued_work() -> "EventFence | None":
    """A fence over every op queued so far on the current stream. On Ascend an event recorded
    there (the host does not wait); elsewhere None, after :func:`synchronize` (on CPU a drain of
    PyNative's queue, free under the CPU's blocking launch; MindSpore's ``Event`` serves Ascend
    and GPU only)."""
    if device_target() == "Ascend":
        import mindspore as ms
        event = ms.runtime.Event()
        event.record()
        return EventFence(event)
    synchronize()
    return None


def drain_launch_queue() -> None:
    """Block until every op PyNative has queued so far has run (``synchronize`` on CPU, for
    callers known to run there); an op that failed in the queue raises here, as it would there."""
    _pipeline_wait()()


@functools.lru_cache(maxsize=1)
def _pipeline_wait():
    # MindSpore's wait for its four PyNative stages (each rethrows an op's failure): what the
    # executor's sync waits for on CPU, without the rest of the executor, which costs more inside
    # a pack; imported once (docs/benchmarks/host-path.md#draining-the-launch-queue).
    try:
        from mindspore._c_expression import _wait_pipeline
        return _wait_pipeline
    except ImportError:          # another MindSpore release
        from mindspore.graph.api import _pynative_executor
        logger.debug("MindSpore has no _wait_pipeline; draining with the executor's sync")
        executor = getattr(_pynative_executor, "_executor", None)
        return getattr(executor, "sync", None) or _pynative_executor.sync


def blocks_launches_by_default(device: str) -> bool:
    """Whether a training process on ``device`` runs ops blocking unless told otherwise: on CPU,
    where ranks share the host's cores; not on Ascend, where async launch keeps the streams fed."""
    return device == "CPU"


def launches_blocking() -> bool:
    """Whether this process runs every op to completion before the next is dispatched
    (``mindspore.runtime.launch_blocking()`` was called), instead of PyNative's async queues."""
    from mindspore._c_expression import RuntimeConf
    return RuntimeConf.get_instance().is_launch_blocking()


def block_launches() -> None:
    """Run every op of this process synchronously from now on (process-wide, no way back). On CPU
    ranks sharing a machine's cores a small model's step gets much faster: every rank's PyNative
    queue threads otherwise compete for them (docs/launch.md#op-launch-on-cpu)."""
    import mindspore as ms
    ms.runtime.launch_blocking()


@functools.lru_cache(maxsize=None)
def _malloc_trim():
    import ctypes
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):     # not glibc: no such call
        return None


def return_free_host_memory() -> bool:
    """Hand the C allocator's free pages back to the OS (glibc's ``malloc_trim``; False without
    it): after a large free glibc raises its mmap threshold, so later large blocks come from the
    heap, which keeps what they free (docs/benchmarks/memory.md#the-host-allocator)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
