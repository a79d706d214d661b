"""The unit-order agreement's tags and message (hyper_parallel/platform/mindspore/fully_shard/
order.py); the agreement itself runs at 2 and 4 ranks in tests/distributed/pattern_cases*.py
(a unit skipped on one rank only)."""
from hypothesis import given, strategies as st

from hyper_parallel.platform.mindspore.fully_shard.order import (GATHER, REDUCE, UNIT_SLOTS,
                                                                 disagreement_message, tag_of,
                                                                 unit_and_kind)


@given(st.integers(0, UNIT_SLOTS - 1), st.sampled_from([GATHER, REDUCE]))
def test_a_tag_names_its_unit_and_collective_exactly_in_float32(unit, kind):
    tag = tag_of(unit, kind)
    assert tag > 0 and float(int(float(tag))) == tag and int(float(tag)) == tag
    assert tag < 1 << 24                 # every such integer is exact in float32
    assert unit_and_kind(tag) == (unit, kind)


def test_tags_of_different_units_or_collectives_differ():
    tags = {tag_of(unit, kind) for unit in range(50) for kind in (GATHER, REDUCE)}
    assert len(tags) == 100


def test_the_message_says_what_each_rank_was_about_to_run():
    names = {3: "'b' (Lin)", 2: "'a' (Lin)"}
    tags = [tag_of(3, GATHER), tag_of(3, GATHER), tag_of(3, GATHER), tag_of(2, REDUCE)]
    message = disagreement_message(tags, names.__getitem__)
    assert "ranks [0, 1, 2] at the all-gather of unit 'b' (Lin)" in message
    assert "rank 3 at the reduce of unit 'a' (Lin)" in message
    assert "same fully_shard units in the same order" in message
