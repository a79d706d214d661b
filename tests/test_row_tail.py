"""Row tails: a layout's reserved elements at the end of every row, and the reducer's ``tag=``
that fills them at launch and hands the reduced tail back (what the unit-order check rides on;
the check itself: tests/test_unit_order.py and tests/distributed/order_cases.py)."""
from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest

from gradpool.comm import SingleProcessCommunicator
from gradpool.layout import ReduceScatterLayout
from gradpool.pack import row_tail, row_tails, write_row_tails
from gradpool.pool import BucketPool
from gradpool.reducer import GradReducer, ReducerConfig
from npref import np_chunk


def test_the_tail_sits_after_the_last_chunk_inside_the_aligned_row():
    plain = ReduceScatterLayout.build([(5, 3), (7,)], 2, alignment=8)
    tailed = ReduceScatterLayout.build([(5, 3), (7,)], 2, alignment=8, tail_numel=5)
    assert tailed.slots == plain.slots
    end = plain.slots[-1].offset + plain.slots[-1].chunk_numel
    assert tailed.tail_offset == end and tailed.row_numel == -(-(end + 5) // 8) * 8
    assert (end, tailed.row_numel) in [(s, e) for s, e in tailed.gaps()]   # written as zeros
    assert not ReduceScatterLayout.build([(8,)], 2, tail_numel=1).is_identity()


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("dtype", [ms.float32, ms.bfloat16])
def test_row_tails_are_written_into_every_row_and_read_back(world, dtype):
    layout = ReduceScatterLayout.build([(5,)], world, alignment=4, tail_numel=3)
    bucket = ms.Tensor(np.full(layout.total_numel, 7, np.float32)).astype(dtype)
    write_row_tails(bucket, layout, ms.Tensor(np.array([1, 0, 2], np.float32)).astype(dtype))
    grid = bucket.astype(ms.float32).asnumpy().copy().reshape(world, layout.row_numel)
    tail = slice(layout.tail_offset, layout.tail_offset + 3)
    assert (grid[:, tail] == [1, 0, 2]).all()
    grid[:, tail] = 7
    assert (grid == 7).all()                          # nothing else written
    assert (row_tails(bucket, layout).astype(ms.float32).asnumpy() == [1, 0, 2]).all()
    assert (row_tail(bucket[:layout.row_numel], layout).astype(ms.float32).asnumpy()
            == [1, 0, 2]).all()


class _Tag:
    """A RowTag recording what it was asked and given."""

    numel = 4

    def __init__(self):
        self.sent, self.reduced = [], []

    def values(self, dtype):
        self.sent.append(dtype)
        return ms.Tensor(np.array([1, 0, 3, 1], np.float32)).astype(dtype)

    def check_reduced(self, tail):
        self.reduced.append(tail.astype(ms.float32).asnumpy().copy())


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_a_tagged_reduce_fills_one_bucket_and_hands_back_its_reduced_tail(host, fused):
    """One bucket of the call (the smallest) carries the tag; the shards are the gradients'."""
    reducer = GradReducer(BucketPool(poison_on_release=True), SingleProcessCommunicator(),
                          ReducerConfig(comm_fusion=fused, host_copies=host))
    grads = [ms.Tensor(np.arange(12, dtype=np.float32).reshape(4, 3)),
             ms.Tensor(np.arange(5, dtype=np.float32) - 2)]
    tag = _Tag()
    result = reducer.reduce_scatter(grads, tag=tag)
    shards = result.wait()
    assert len(tag.sent) == 1 and len(tag.reduced) == 1
    assert (tag.reduced[0] == [1, 0, 3, 1]).all()
    tagged = [item.bucket for item in result.launched if item.bucket.tag is tag]
    smallest = min(item.bucket.layout.data_numel for item in result.launched)
    assert len(tagged) == 1 and tagged[0].layout.data_numel == smallest
    for shard, grad in zip(shards, grads):
        np.testing.assert_array_equal(shard.asnumpy(), np_chunk(grad.asnumpy(), 0, 0, 1))
    result.wait()
    assert len(tag.reduced) == 1                      # compared once per result
    result.release()


def test_micro_steps_add_gradients_not_tags():
    """Packed with a tag, accumulated twice, launched: the tail holds the tag once."""
    reducer = GradReducer(BucketPool(), SingleProcessCommunicator())
    grad = ms.Tensor(np.ones((3, 3), np.float32))
    tag = _Tag()
    buckets = reducer.pack([grad], allow_borrow=False, tag=tag)
    reducer.accumulate(buckets, [grad])
    reducer.accumulate(buckets, [grad])
    result = reducer.launch(buckets)
    np.testing.assert_array_equal(result.wait()[0].asnumpy(), np.full((3, 3), 3, np.float32))
    assert (tag.reduced[0] == [1, 0, 3, 1]).all()
    result.release()
