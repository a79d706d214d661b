"""The memory of one gathered (full) parameter: allocated here, released after forward, regrown
and refilled in place before backward.

Why in place: autograd saves the tensor a unit's forward computed with, so the memory can be
given back after forward only if the *same tensor* is refilled before backward reads it. Its
storage is resized to 0 bytes and regrown (as upstream hyper_parallel and PyTorch FSDP2 do) and
refilled through ``.data``, which does not bump its version: after a plain ``copy_`` MindSpore's
backward refuses the saved tensor ("modified by an inplace operation";
``shared/probes/reshard_storage.py``).

Ownership: :func:`_resize_storage`, gradpool's second storage-resizing path beside the pool's
``_release_storage``, takes an :class:`_Allocation`, made only by :class:`GatheredParam` around a
tensor it allocated, so a caller's tensor can never be resized (``tests/test_pool.py`` checks
both paths on the source). ``poison=True`` (debug): a release fills the memory with NaN and keeps
it, so a read before the refill shows NaN instead of whatever the allocator left.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mindspore as ms
import numpy as np
from mindspore import mint

from gradpool.dtypes import check_dtype, itemsize, overwrite
from gradpool.errors import InvalidArgumentError, LeaseStateError, check_bool


@dataclass(eq=False, slots=True)
class _Allocation:
    """gradpool's record of one full-parameter allocation (never handed out)."""

    tensor: ms.Tensor       # allocated by GatheredParam, whole storage, offset 0
    nbytes: int


def _resize_storage(record: _Allocation, nbytes: int) -> None:
    """Release (0) or regrow (``record.nbytes``) the storage of a tensor gradpool allocated."""
    record.tensor.untyped_storage().resize_(nbytes)


@dataclass
class GatheredStats:
    """What one gathered parameter's memory went through (counters)."""

    fills: int = 0
    releases: int = 0        # memory given back (or poisoned)
    regrows: int = 0         # memory taken again after a release


class GatheredParam:
    """A full parameter of ``shape`` and ``dtype`` whose memory comes and goes: ``tensor`` is the
    same object for the record's whole life (autograd may hold it); ``resident`` says whether its
    memory is held, ``valid`` whether it holds the last fill."""

    def __init__(self, shape: tuple, dtype, *, poison: bool = False):
        check_dtype(dtype)
        check_bool("poison", poison)
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise InvalidArgumentError(f"a gathered parameter's shape must be >= 0, got {shape}")
        nbytes = math.prod(shape) * itemsize(dtype)
        self._record = _Allocation(mint.empty(shape, dtype=dtype), nbytes)
        self.shape, self.dtype, self.poison = shape, dtype, poison
        self.resident = True
        self.valid = False
        self.stats = GatheredStats()

    @property
    def tensor(self) -> ms.Tensor:
        return self._record.tensor

    @property
    def nbytes(self) -> int:
        return self._record.nbytes

    @property
    def resident_bytes(self) -> int:
        return self._record.nbytes if self.resident else 0

    def fill(self, full: ms.Tensor) -> ms.Tensor:
        """Write ``full`` (cast) into the memory via :meth:`target`; returns :attr:`tensor`."""
        if tuple(full.shape) != self.shape:
            raise InvalidArgumentError(
                f"cannot fill a gathered parameter of shape {self.shape} with shape "
                f"{tuple(full.shape)}")
        target = self.target()
        if self.nbytes:
            overwrite(target, full.reshape(-1))
        return self.filled()

    def target(self) -> ms.Tensor:
        """The memory, regrown if it was released, as a flat tensor for a writer that fills it
        without bumping the tensor's version (:meth:`fill`, or an all-gather straight into it);
        call :meth:`filled` once it is written."""
        if not self.resident:
            _resize_storage(self._record, self._record.nbytes)
            self.resident = True
            self.stats.regrows += 1
        return self.tensor.data.reshape(-1)

    def filled(self) -> ms.Tensor:
        """Mark the memory written (by :meth:`target`'s writer); returns :attr:`tensor`."""
        self.valid = True
        self.stats.fills += 1
        return self.tensor

    def release(self) -> None:
        """Give the memory back (poison: fill it with NaN and keep it); a no-op when released."""
        if not self.valid and not self.resident:
            return
        self.valid = False
        self.stats.releases += 1
        if self.poison:
            if self.nbytes:   # a copy: slice assignment under autograd writes a new tensor
                nans = ms.Tensor(np.full(self.nbytes // itemsize(self.dtype), np.nan, np.float32))
                overwrite(self.tensor.data.reshape(-1), nans)
            return
        _resize_storage(self._record, 0)
        self.resident = False

    def check_valid(self) -> None:
        """Raise :class:`LeaseStateError` when the memory was released and not refilled."""
        if not self.valid:
            raise LeaseStateError(
                f"gathered parameter {self.shape} x {self.dtype} was released after forward and "
                "has not been gathered again; gather it (unshard) before reading it")

    def __repr__(self) -> str:
        state = "valid" if self.valid else ("resident" if self.resident else "released")
        return f"GatheredParam({self.shape} x {self.dtype}, {state})"
