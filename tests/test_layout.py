"""gradpool.layout against a NumPy model of a reduce-scatter (the layout needs no MindSpore), its
exact error messages, hand-built layouts, and the layout's table of the bad-input matrix."""
import math
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gradpool.errors import GradPoolError, InvalidArgumentError
from gradpool.layout import GradSlot, ReduceScatterLayout
from bad_inputs import LAYOUT_CASES, assert_refused_typed
from npref import np_pack, np_shards


shape_st = st.lists(st.integers(1, 5), min_size=0, max_size=3).flatmap(
    lambda rest: st.integers(1, 37).map(lambda d0: (d0, *rest)))


@settings(max_examples=150, deadline=None)
@given(shapes=st.lists(shape_st, min_size=1, max_size=5), world=st.integers(1, 8),
       alignment=st.sampled_from([1, 16, 128]), data=st.data())
def test_reduce_scatter_through_layout_matches_numpy(shapes, world, alignment, data):
    dims = [data.draw(st.integers(0, len(s) - 1)) for s in shapes]
    layout = ReduceScatterLayout.build(shapes, world, alignment, shard_dims=dims)
    rng = np.random.default_rng(0)
    per_rank_grads = [[rng.standard_normal(s) for s in shapes] for _ in range(world)]
    buckets = np.stack([np_pack(g, layout) for g in per_rank_grads])
    reduced = buckets.sum(axis=0).reshape(world, layout.row_numel)   # what reduce-scatter does
    for rank in range(world):
        got = np_shards(reduced[rank], layout)
        for slot, shard in zip(layout.slots, got):
            total = sum(g[slot.index] for g in per_rank_grads)
            start = rank * slot.chunk_size
            valid = slot.valid_length(rank)
            want = np.take(total, range(start, start + valid), axis=slot.shard_dim)
            np.testing.assert_allclose(
                np.take(shard, range(valid), axis=slot.shard_dim), want, rtol=1e-12)
            tail = np.take(shard, range(valid, slot.chunk_size), axis=slot.shard_dim)
            assert not tail.any(), "uneven-shard padding rows must stay zero"


@settings(max_examples=200, deadline=None)
@given(shapes=st.lists(shape_st, min_size=1, max_size=6), world=st.integers(1, 8),
       alignment=st.sampled_from([1, 16, 128]))
def test_offsets_aligned_disjoint_and_padding_reported(shapes, world, alignment):
    layout = ReduceScatterLayout.build(shapes, world, alignment)
    assert layout.row_numel % alignment == 0
    ranges = sorted(layout.flat_range(i, r) for i in range(len(shapes)) for r in range(world))
    for (s0, e0), (s1, _) in zip(ranges, ranges[1:]):
        assert e0 <= s1, "chunks overlap"
    assert all(s % alignment == 0 for s, _ in ranges)
    assert ranges[-1][1] <= layout.total_numel
    used = sum(e - s for s, e in ranges)
    shard_pad = sum(s.shard_padding_numel for s in layout.slots)
    gaps = sum(e - s for s, e in layout.gaps()) * world
    assert layout.padding_numel == layout.total_numel - sum(math.prod(s) for s in shapes)
    assert layout.padding_numel == shard_pad + gaps
    assert used + gaps == layout.total_numel


def test_example_offsets():
    layout = ReduceScatterLayout.build([(5, 3), (4,)], world_size=2, alignment=4)
    assert [s.offset for s in layout.slots] == [0, 12]
    assert [s.chunk_shape for s in layout.slots] == [(3, 3), (2,)]
    assert layout.row_numel == 16 and layout.total_numel == 32
    assert layout.padding_numel == 32 - 19
    assert layout.slots[0].valid_length(1) == 2
    assert layout.flat_range(1, 1) == (28, 30)
    assert layout.gaps() == ((9, 12), (14, 16))


def test_identity_only_for_single_even_unpadded_gradient():
    assert ReduceScatterLayout.build([(8, 4)], 2, 16).is_identity()
    assert not ReduceScatterLayout.build([(7, 4)], 2, 1).is_identity()
    assert not ReduceScatterLayout.build([(8, 3)], 2, 16).is_identity()
    assert not ReduceScatterLayout.build([(8, 4), (2,)], 2, 1).is_identity()
    assert not ReduceScatterLayout.build([(8, 4)], 2, 1, shard_dims=[1]).is_identity()


@pytest.mark.parametrize("kwargs, needle", [
    (dict(shapes=[(4,)], world_size=0), "world_size must be an int >= 1, got 0"),
    (dict(shapes=[(4,)], world_size=-3), "got -3"),
    (dict(shapes=[], world_size=2), "empty list"),
    (dict(shapes=[(4, 0)], world_size=2), "(4, 0)"),
    (dict(shapes=[(4,)], world_size=2, alignment=0), "alignment must be an int >= 1"),
    (dict(shapes=[(4, 2)], world_size=2, shard_dims=[2]), "dim 2"),
])
def test_bad_layouts_name_the_value(kwargs, needle):
    with pytest.raises(InvalidArgumentError) as err:
        ReduceScatterLayout.build(**kwargs)
    assert needle in str(err.value)


def test_layout_is_pure_python():
    import subprocess
    code = "import sys, gradpool.layout; print('mindspore' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_layout_is_frozen():
    layout = ReduceScatterLayout.build([(4,)], 2)
    with pytest.raises(AttributeError):
        layout.row_numel = 3


@given(st.lists(st.tuples(st.sampled_from(["f32", "bf16"]), st.integers(1, 64)), max_size=30),
       st.integers(1, 128))
def test_fusion_groups_keep_order_per_dtype_and_stay_under_the_cap(items, cap):
    from gradpool.layout import fusion_groups
    groups = fusion_groups(items, cap)
    assert sorted(i for _, g in groups for i in g) == list(range(len(items)))
    for dtype, indices in groups:
        assert indices == sorted(indices) and all(items[i][0] == dtype for i in indices)
        total = sum(items[i][1] for i in indices)
        assert total <= cap or len(indices) == 1           # only a lone oversized gradient
    # a bucket closes only when the next gradient of its dtype would pass the cap
    for dtype in {d for d, _ in items}:
        mine = [g for d, g in groups if d == dtype]
        for closed, following in zip(mine, mine[1:]):
            assert sum(items[i][1] for i in closed) + items[following[0]][1] > cap
    assert fusion_groups(items, cap, fused=False) == [(d, [i]) for i, (d, _) in enumerate(items)]


# -- exact messages, rows and gaps, a hand-built layout -------------------------------------------
def test_grad_slot_of_shards_dim_0_by_default():
    slot = GradSlot.of((5, 3), 2)
    assert (slot.shard_dim, slot.chunk_size, slot.chunk_shape) == (0, 3, (3, 3))
    assert GradSlot.of((5, 3), 2, 1).chunk_shape == (5, 2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(shapes=[], world_size=2),
     "a layout needs at least one gradient shape, got an empty list"),
    (dict(shapes=[(4,), (2, 2)], world_size=2, shard_dims=[0]),
     "shard_dims has 1 entries for 2 shapes; give one per shape"),
    (dict(shapes=[()], world_size=2),
     "gradient 0 has shape (); shapes need >= 1 dim and every dim >= 1"),
    (dict(shapes=[(4,), (3, 2)], world_size=2, shard_dims=[0, -1]),
     "gradient 1's shard dim must be an int >= 0, got -1"),
    (dict(shapes=[(4, 2)], world_size=2, shard_dims=[2]),
     "gradient 0 of shape (4, 2) cannot be sharded on dim 2"),
])
def test_layout_errors_say_exactly_what_was_wrong(kwargs, message):
    with pytest.raises(GradPoolError) as err:
        ReduceScatterLayout.build(**kwargs)
    assert str(err.value) == message


def test_layout_shard_dim_must_be_an_int_named_in_the_error():
    with pytest.raises(GradPoolError) as err:
        ReduceScatterLayout.build([(4, 2)], 2, shard_dims=[1.0])
    assert str(err.value).startswith("gradient 0's shard dim must be an int")


def test_row_without_tail_has_no_empty_gap():
    """A row the chunks fill exactly has no trailing gap, not an empty one."""
    layout = ReduceScatterLayout.build([(4,)], 2, 2)
    assert layout.row_numel == 2
    assert layout.row_segments() == ((2, layout.slots[0]),)
    assert layout.gaps() == ()
    filled = ReduceScatterLayout.build([(3,), (4,)], 2, 2)
    assert [length for length, _ in filled.row_segments()] == [2, 2]
    assert filled.gaps() == ()


def test_layout_records_its_alignment():
    layout = ReduceScatterLayout.build([(5, 3), (4,)], 2, 4)
    assert (layout.world_size, layout.alignment, layout.row_numel) == (2, 4, 16)


def test_row_segments_report_a_leading_gap_of_a_hand_built_layout():
    """The layout is a public frozen dataclass: a row whose first chunk starts past 0 begins with
    a zero gap of exactly that length, so gaps() starts at 0."""
    slot = GradSlot(index=0, shape=(4,), shard_dim=0, chunk_size=2, offset=3, world_size=2)
    layout = ReduceScatterLayout(world_size=2, alignment=1, slots=(slot,), row_numel=6)
    assert layout.row_segments() == ((3, None), (2, slot), (1, None))
    assert layout.gaps() == ((0, 3), (5, 6))


# -- the layout's table of the bad-input matrix (tests/bad_inputs.py) -----------------------------
@pytest.mark.parametrize("name", sorted(LAYOUT_CASES))
def test_bad_input_is_refused_typed_naming_the_value(name):
    assert_refused_typed(name)
