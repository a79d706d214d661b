"""The device target, its memory size, and waiting for queued work on it (PyNative launches ops
asynchronously). MindSpore is imported on first use, so the device list costs nothing to read
(the benchmark report and the config loader need only that)."""
from __future__ import annotations

import os

SUPPORTED_DEVICES = ("CPU", "Ascend")
# An Ascend 910B card's HBM (64 GB): no bucket can be larger than the card.
ASCEND_910B_HBM_BYTES = 64 * 2 ** 30


def device_memory_bytes(device: str) -> int:
    """The most memory one allocation on ``device`` could ever get: the host's physical memory on
    CPU, the card's HBM on Ascend."""
    if device == "Ascend":
        return ASCEND_910B_HBM_BYTES
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def device_target() -> str:
    import mindspore as ms
    return ms.get_context("device_target")


def synchronize() -> None:
    """Block until every op launched so far has run.

    ``ms.runtime.synchronize`` serves Ascend only (on CPU it logs "CPU device is not supported"),
    so the CPU backend drains PyNative's launch queue instead."""
    if device_target() == "Ascend":
        import mindspore as ms
        ms.runtime.synchronize()
    else:
        from mindspore.graph.api import _pynative_executor
        _pynative_executor.sync()
