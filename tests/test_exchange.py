"""gradpool.exchange at world 1 against NumPy: the 16-bit limb encoding of int64 (and uint64)
values, on values that show a limb bug (negatives, above 2**24 and 2**48, the int64 extremes),
and the typed refusals. Between 2 real ranks: tests/distributed/comm_cases.py (exchange_*)."""
from __future__ import annotations

import numpy as np
import pytest

from gradpool import (InvalidArgumentError, SingleProcessCommunicator, all_sum, all_sum_ints,
                      exchange_ints, exchange_values)
from gradpool.exchange import LIMBS, int_limbs, ints_from_limbs

INT64 = np.iinfo(np.int64)
# each one wrong under some limb bug: a lost sign, a limb rounded in float32 (2**24 + 1), a top
# limb dropped (2**48 + ...), a shift off by one, a carry between limbs
SHOWING = [0, 1, -1, -2 ** 16, 2 ** 16 - 1, 2 ** 24 + 1, -(2 ** 24 + 1), 2 ** 32 + 7,
           2 ** 48 + 12345, -(2 ** 48) - 3, 0x0123_4567_89AB_CDEF, INT64.max, INT64.min]
WORLD_1 = SingleProcessCommunicator()


def test_limbs_are_16_bit_and_exact_in_float32():
    limbs = int_limbs(np.array(SHOWING, np.int64))
    assert limbs.dtype == np.float32 and limbs.size == LIMBS * len(SHOWING)
    assert limbs.min() >= 0 and limbs.max() < 2 ** 16
    assert np.array_equal(limbs.astype(np.int64), limbs)        # whole numbers
    # limb j of value v is bits [16 j, 16 j + 16) of its two's complement, by NumPy
    bits = np.array(SHOWING, np.int64).view(np.uint64)
    expected = [(int(b) >> (16 * j)) & 0xFFFF for b in bits for j in range(LIMBS)]
    assert limbs.astype(np.int64).tolist() == expected
    assert ints_from_limbs(limbs).tolist() == SHOWING


def test_exchange_ints_at_world_1_returns_each_value_exactly():
    got = exchange_ints(WORLD_1, SHOWING)
    assert got.dtype == np.int64 and got.shape == (1, len(SHOWING))
    assert got[0].tolist() == SHOWING
    assert all_sum_ints(WORLD_1, SHOWING).tolist() == SHOWING
    assert exchange_ints(WORLD_1, []).shape == (1, 0)


def test_unsigned_values_keep_all_64_bits():
    ids = [2 ** 64 - 1, 2 ** 63, 2 ** 63 - 1, 0xDEAD_BEEF_0BAD_F00D, 0]
    got = exchange_ints(WORLD_1, ids, unsigned=True)
    assert got.dtype == np.uint64 and [int(v) for v in got[0]] == ids


def test_ints_and_floats_travel_together():
    got = exchange_values(WORLD_1, ints=[2 ** 50 + 1, -7], floats=[0.1, -2.5, 1e30])
    assert got.ints.tolist() == [[2 ** 50 + 1, -7]]
    assert got.floats.dtype == np.float32
    assert np.array_equal(got.floats, np.array([[0.1, -2.5, 1e30]], np.float32))


def test_all_sum_keeps_the_shape_and_float32_values():
    values = np.arange(15, dtype=np.float64).reshape(3, 5) * 0.1
    got = all_sum(WORLD_1, values)
    assert got.shape == (3, 5) and got.dtype == np.float32
    assert np.array_equal(got, values.astype(np.float32))


@pytest.mark.parametrize("values, unsigned, needle", [
    ([1.5], False, "flat sequence of ints"),
    ([[1, 2]], False, "flat sequence of ints"),
    ([2 ** 63], False, "must fit in int64, got 9223372036854775808; pass unsigned=True"),
    ([INT64.min - 1], False, "must fit in int64"),
    ([-1], True, "must fit in uint64, got -1"),
    ([2 ** 64], True, "must fit in uint64"),
])
def test_values_that_cannot_travel_are_refused_by_value(values, unsigned, needle):
    with pytest.raises(InvalidArgumentError, match=needle.replace("(", r"\(")):
        exchange_ints(WORLD_1, values, unsigned=unsigned)
