"""The device target, and waiting for queued work on it (PyNative launches ops asynchronously)."""
from __future__ import annotations

import mindspore as ms

SUPPORTED_DEVICES = ("CPU", "Ascend")


def device_target() -> str:
    return ms.get_context("device_target")


def synchronize() -> None:
    """Block until every op launched so far has run.

    ``ms.runtime.synchronize`` serves Ascend only (on CPU it logs "CPU device is not supported"),
    so the CPU backend drains PyNative's launch queue instead."""
    if device_target() == "Ascend":
        ms.runtime.synchronize()
    else:
        from mindspore.graph.api import _pynative_executor
        _pynative_executor.sync()
