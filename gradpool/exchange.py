"""Small host values every rank tells every other rank: counters, ids, digests, flags, losses.

Every backend all-reduces float32 (the CPU collectives have no integer kernel), and float32 holds
integers exactly only up to 2 ** 24: a byte count, a generation or a 64-bit digest sent whole
would arrive rounded. So an integer travels as four 16-bit limbs of its 64 bits (two's
complement, so negatives too), each limb exact in float32, and every rank writes only its own
row of a ``[world, width]`` buffer that one sum all-reduce fills: every element is one rank's
limb plus zeros, so the sum is exact. Floats travel as float32.

:func:`exchange_values` is the one transport; :func:`exchange_ints`, :func:`all_sum_ints` and
:func:`all_sum` are the shapes callers need. Every rank of ``comm`` calls them, in the same
order, with the same number of values. At world size 1 the values still go through the encoding
(there is nothing to all-reduce), so a world-1 run exercises the same code as a real one.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import mindspore as ms
import numpy as np

from gradpool.errors import InvalidArgumentError

LIMB_BITS = 16
LIMBS = 64 // LIMB_BITS
_SHIFTS = np.arange(LIMBS, dtype=np.uint64) * np.uint64(LIMB_BITS)
_LIMB_MASK = np.uint64((1 << LIMB_BITS) - 1)


class Exchanged(NamedTuple):
    ints: np.ndarray        # [world, number of ints] int64 (uint64 if unsigned): row r is rank r's
    floats: np.ndarray      # [world, number of floats] float32


def _as_words(values, unsigned: bool) -> np.ndarray:
    """``values`` as a 1-D int64 array of their 64 bits; anything else (a float, a nested list,
    a value outside int64, or outside uint64 when ``unsigned``) refused. Python ints are checked
    one by one: NumPy would turn a list mixing ints above 2**63 into float64, silently."""
    if isinstance(values, np.ndarray):
        items = values.tolist() if values.ndim == 1 and values.dtype.kind in "biu" else None
    else:
        items = list(values)
        if not all(isinstance(v, (int, np.integer)) for v in items):
            items = None
    if items is None:
        raise InvalidArgumentError(f"integers to exchange must be a flat sequence of ints, got "
                                   f"{values!r}; pass floats as floats")
    dtype = np.uint64 if unsigned else np.int64
    info = np.iinfo(dtype)
    outside = [int(v) for v in items if not info.min <= int(v) <= info.max]
    if outside:
        raise InvalidArgumentError(
            f"integers to exchange must fit in {info.dtype}, got {outside[0]}"
            + ("" if unsigned else "; pass unsigned=True for 64-bit unsigned ids and digests"))
    return np.array([int(v) for v in items], dtype).reshape(-1).view(np.int64)


def int_limbs(values: np.ndarray) -> np.ndarray:
    """``[n * LIMBS]`` float32: each int64 of ``values`` as its 16-bit limbs, lowest first."""
    bits = values.astype(np.int64).view(np.uint64)
    return ((bits[:, None] >> _SHIFTS) & _LIMB_MASK).astype(np.float32).reshape(-1)


def ints_from_limbs(limbs: np.ndarray) -> np.ndarray:
    """Inverse of :func:`int_limbs` over the last axis (``[..., n * LIMBS]`` -> ``[..., n]``)."""
    digits = np.rint(limbs).astype(np.uint64).reshape(*limbs.shape[:-1], -1, LIMBS)
    return np.bitwise_or.reduce(digits << _SHIFTS, axis=-1).view(np.int64)


def _all_reduce_sum(comm, buf: np.ndarray) -> np.ndarray:
    """The float32 sum over ranks of ``buf`` (any shape); ``buf`` itself at world size 1."""
    if comm.world_size == 1:
        return buf
    tensor = ms.Tensor(np.ascontiguousarray(buf, np.float32).reshape(-1))
    comm.all_reduce(tensor, op="sum").wait()
    return tensor.asnumpy().reshape(buf.shape)


def exchange_values(comm, ints: Sequence[int] = (), floats: Sequence[float] = (),
             unsigned: bool = False) -> Exchanged:
    """Every rank's ``ints`` (exact: int64, or uint64 when ``unsigned``) and ``floats`` (as
    float32), on every rank, by one all-reduce; every rank passes as many of each."""
    words = _as_words(ints, unsigned)
    floats = np.asarray(floats, np.float32).reshape(-1)
    limbs = int_limbs(words)
    row = np.concatenate([limbs, floats])
    buf = np.zeros((comm.world_size, row.size), np.float32)
    buf[comm.rank] = row
    rows = _all_reduce_sum(comm, buf)
    got = ints_from_limbs(rows[:, :limbs.size])
    return Exchanged(got.view(np.uint64) if unsigned else got, rows[:, limbs.size:].copy())


def exchange_ints(comm, values: Sequence[int], unsigned: bool = False) -> np.ndarray:
    """``[world, n]`` int64 (uint64 when ``unsigned``): row r is rank r's ``values``, exactly."""
    return exchange_values(comm, ints=values, unsigned=unsigned).ints


def all_sum_ints(comm, values: Sequence[int]) -> np.ndarray:
    """``[n]`` int64: the exact sum over ranks of each of ``values`` (int64 wrap-around)."""
    return exchange_ints(comm, values).sum(axis=0, dtype=np.int64)


def all_sum(comm, values) -> np.ndarray:
    """``values``' float32 sum over ranks, elementwise, in ``values``' shape (one all-reduce
    of as many elements: for arrays, e.g. tensor values or bytes, not per-rank rows)."""
    return _all_reduce_sum(comm, np.array(values, np.float32))
