"""Where a bucket is written: one interface (:class:`BucketWriter`), a writer per pool device.

The device writer (:data:`gradpool.pack.DEVICE`) writes with MindSpore ops, the path Ascend runs;
the host writer (:class:`gradpool.host.writer.HostWriter`) writes a CPU pool's buckets through
their host memory. A reducer asks :func:`writer_for` once, when made (so the host writer compiles
its loops outside any training step). The functions below, the façade's ``pack_bucket``,
``accumulate_bucket`` and ``unpack_gathered``, choose per call (``hyper_parallel``'s all-gather
holds a lease and ``host_copies``, not a writer).
"""
from __future__ import annotations

import functools
from typing import Protocol, Sequence

import mindspore as ms
import numpy as np
from mindspore import mint

from gradpool.device import device_target, drain_launch_queue
from gradpool.dtypes import host_alias
from gradpool.errors import InPlaceOpError

from gradpool.host.writer import host_writer
from gradpool.layout import ReduceScatterLayout
from gradpool.pack import DEVICE, Written
from gradpool.pool import Lease


class BucketWriter(Protocol):
    """Writes of one kind into pool buckets; each takes its inputs explicitly and returns what it
    wrote (the caller records statistics). Caller tensors are only ever read."""

    def pack(self, lease: Lease, grads: Sequence[ms.Tensor],
             layout: ReduceScatterLayout) -> Written: ...

    def accumulate(self, lease: Lease, grads: Sequence[ms.Tensor],
                   layout: ReduceScatterLayout) -> Written: ...

    def unpack_gathered(self, lease: Lease, layout: ReduceScatterLayout) -> list[ms.Tensor]: ...


def writer_for(device: str, host: bool = True) -> BucketWriter:
    """The writer of a pool on ``device``: the host writer on CPU unless ``host`` is False
    (``ReducerConfig.host_copies``: False tests the device path on CPU), else the device one."""
    return host_writer() if host and device == "CPU" else DEVICE


def pack(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout, *,
         host: bool) -> Written:
    """Write ``grads`` into ``lease`` per ``layout``: cast to the lease dtype, pad with zeros;
    ``host``: through host memory where the pool is on the CPU (:func:`writer_for`)."""
    return writer_for(lease.pool.device, host).pack(lease, grads, layout)


def accumulate(lease: Lease, grads: Sequence[ms.Tensor], layout: ReduceScatterLayout, *,
               host: bool) -> Written:
    """:func:`gradpool.pack.accumulate` by the pool's writer (``host`` as in :func:`pack`)."""
    return writer_for(lease.pool.device, host).accumulate(lease, grads, layout)


def unpack_gathered(lease: Lease, layout: ReduceScatterLayout, *, host: bool) -> list[ms.Tensor]:
    """:func:`gradpool.pack.unpack_gathered` by the pool's writer (``host`` as in :func:`pack`)."""
    return writer_for(lease.pool.device, host).unpack_gathered(lease, layout)


@functools.lru_cache(maxsize=None)
def _in_place_add_takes_effect(device: str) -> bool:
    probe = mint.zeros((1,), dtype=ms.float32)
    probe.add_(mint.ones((1,), dtype=ms.float32))
    return float(probe.asnumpy()[0]) == 1.0      # the one host read: once per process and device


def check_in_place_add() -> None:
    """Raise :class:`InPlaceOpError` unless ``Tensor.add_`` takes effect on this device: one tiny
    add, read on the host once per process (the CPU backend's ``add_`` of a plain tensor leaves
    it unchanged; an accumulation relying on it would silently drop gradients)."""
    device = device_target()
    if not _in_place_add_takes_effect(device):
        raise InPlaceOpError(
            f"Tensor.add_ left its target unchanged on {device}: main_grad cannot accumulate in "
            "place here; set GradPoolConfig(main_grad_in_place=False) (YAML "
            "gradpool.main_grad_in_place: false) to add out of place, a new main_grad per reduce")


def add_in_place(target: ms.Tensor, addend: ms.Tensor) -> bool:
    """``target += addend`` through host memory (contiguous CPU tensors of one dtype and size):
    no new tensor and no op left queued. On the CPU backend ``Tensor.add_`` silently leaves a
    plain tensor unchanged, and the out-of-place add queued inside a unit's backward, one per
    parameter, made the synchronous main_grad reduce 1.55-1.85x the asynchronous one under
    PyNative's asynchronous launch (0.99x this way, bit for bit the same sums). False, with
    nothing written, where either tensor has no such memory: the caller adds with ops."""
    drain_launch_queue()            # queued ops writing either tensor have run
    into, source = host_alias(target), host_alias(addend)
    if into is None or source is None or into.size != source.size or into.dtype != source.dtype:
        return False
    np.add(into, source, out=into)
    return True
