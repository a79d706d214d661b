"""The unit-order check's pieces in one process (hyper_parallel/platform/mindspore/fully_shard/
order.py, order_flag.py): unit identity, tags, their encoding in bucket rows and the device
comparison against NumPy sums, the message. The check itself runs on 2 and 4 msrun ranks in
tests/distributed/order_cases.py and pattern_cases_4.py."""
import ml_dtypes
import mindspore as ms
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gradpool import GradPoolConfig
from hyper_parallel.platform.mindspore.fully_shard.order import (GATHER, IDENTITY_BITS, REDUCE,
                                                                 TAG_BITS, TAG_NUMEL,
                                                                 disagreement_message, flag_mask,
                                                                 tag_of, tag_slots, unit_and_kind,
                                                                 unit_identity)
from hyper_parallel.platform.mindspore.fully_shard.order_flag import OrderFlag, UnitTag

identities = st.integers(0, (1 << IDENTITY_BITS) - 1)


@given(identities, st.sampled_from([GATHER, REDUCE]))
def test_a_tag_names_its_unit_and_collective_exactly_in_float32(identity, kind):
    tag = tag_of(identity, kind)
    assert 0 <= tag < 1 << 24 and int(np.float32(tag)) == tag   # exact on the failure path
    assert unit_and_kind(tag) == (identity, kind)


def test_identity_comes_from_path_class_and_parameters_not_from_an_order():
    params = [("layers.0.w", (7, 7)), ("layers.0.b", (7,))]
    same = unit_identity("layers.0", "Block", params)
    assert same == unit_identity("layers.0", "Block", list(params))
    others = {unit_identity("layers.1", "Block", params),
              unit_identity("layers.0", "Other", params),
              unit_identity("layers.0", "Block", [("layers.0.w", (7, 8)), params[1]]),
              unit_identity("layers.0", "Block", params[:1])}
    assert same not in others and len(others) == 4


def _summed(tags, dtype, world_op, flags=None):
    """What a reduce of each rank's tag values gives, in ``dtype``, summed in rank order with
    rounding at every add (as a ring would), averaged when ``world_op == "avg"``. ``flags``:
    each rank's raised flag (a count), added to its last pair as the ranks send it."""
    flags = flags if flags is not None else [0] * len(tags)
    total = np.zeros(TAG_NUMEL, dtype)
    for tag, flag in zip(tags, flags):
        sent = (tag_slots(tag) + flag * flag_mask()).astype(dtype).astype(np.float32)
        total = (total.astype(np.float32) + sent).astype(dtype)
    if world_op == "avg":
        total = (total.astype(np.float32) / len(tags)).astype(dtype)
    return total


def _pair_minima(total) -> np.ndarray:
    pairs = total.astype(np.float32).reshape(TAG_BITS, 2)
    return np.minimum(pairs[:, 0], pairs[:, 1])


@settings(max_examples=40, deadline=None)
@given(identities, identities, st.integers(2, 4096), st.sampled_from(["sum", "avg"]),
       st.sampled_from([np.float32, np.float16, ml_dtypes.bfloat16]),
       st.sampled_from([0, 1, 7, 70000]))
def test_a_reduce_of_the_tags_shows_a_mismatch_in_every_dtype_at_any_world_size(
        first, second, world, op, dtype, flag):
    """Sums of values >= 0 are zero only when every value is: a pair with both sums nonzero
    exactly when two ranks sent different bits, or a rank raised its flag, whatever the rounding
    (float16, bfloat16, thousands of ranks, sum or average; a count past float16's range goes
    to infinity, still nonzero)."""
    same = _summed([tag_of(first, GATHER)] * world, dtype, op)
    assert not _pair_minima(same).any()
    tags = [tag_of(first, REDUCE)] * (world - 1) + [tag_of(second, REDUCE)]
    mixed = _summed(tags, dtype, op)
    assert _pair_minima(mixed).any() == (first != second)
    flagged = _summed([tag_of(first, REDUCE)] * world, dtype, op, [0] * (world - 1) + [flag])
    assert _pair_minima(flagged).any() == (flag > 0)


@pytest.mark.parametrize("dtype", [ms.float32, ms.bfloat16])
def test_the_device_comparison_reads_what_numpy_sums_say(dtype):
    """OrderFlag on the device, fed what a reduce or an all-gather of two ranks' tail would
    hold: a mismatch only when the tags differ or a sender raised its flag; one read."""
    flag = OrderFlag()
    a, b = UnitTag(flag, tag_of(5, REDUCE)), UnitTag(flag, tag_of(9, REDUCE))

    def tail(*tags):
        return ms.Tensor(sum(t.values(ms.float32).asnumpy() for t in tags)).astype(dtype)
    flag.check_reduced(tail(a, a))
    assert flag.pending and flag.read() is False
    flag.check_reduced(tail(a, a))
    flag.check_reduced(tail(a, b))
    flag.check_reduced(tail(b, b))
    assert flag.read() is True          # kept once set
    assert not flag.pending             # read: starts over
    rows = ms.Tensor(np.stack([a.values(ms.float32).asnumpy()] * 2)).astype(dtype)
    a.check_gathered(rows)
    assert flag.read() is False
    rows = ms.Tensor(np.stack([a.values(ms.float32).asnumpy(),
                               b.values(ms.float32).asnumpy()])).astype(dtype)
    a.check_gathered(rows)
    assert flag.read() is True
    # a flag raised on one rank travels on its tag's last pair: the next collective shows it
    a.check_gathered(rows)
    sent = a.values(ms.float32).asnumpy()
    np.testing.assert_array_equal(sent, tag_slots(a.tag) + flag_mask())
    a.check_gathered(ms.Tensor(np.stack([tag_slots(a.tag), sent])).astype(dtype))
    flag.check_reduced(ms.Tensor(tag_slots(a.tag) + sent).astype(dtype))
    sent = a.values(ms.float32).asnumpy()
    np.testing.assert_array_equal(sent, tag_slots(a.tag) + 3 * flag_mask())    # a count
    assert flag.read() is True
    np.testing.assert_array_equal(a.values(ms.float32).asnumpy(), tag_slots(a.tag))
    a.check_gathered(ms.Tensor(np.stack([tag_slots(a.tag)] * 2)).astype(dtype))
    flag.check_reduced(ms.Tensor(2 * tag_slots(a.tag)).astype(dtype))
    assert flag.read() is False


def test_a_tag_is_recorded_once_per_collective_launch():
    flag = OrderFlag()
    tag = UnitTag(flag, tag_of(3, GATHER))
    tag.values(ms.float32)
    UnitTag(flag, tag_of(3, REDUCE)).values(ms.bfloat16)
    assert flag.recorded == [tag_of(3, GATHER), tag_of(3, REDUCE)] and flag.reduced


def test_the_message_says_what_each_rank_ran():
    names = {3: "'b' (Lin)", 2: "'a' (Lin)"}
    tags = [tag_of(3, GATHER), tag_of(3, GATHER), tag_of(3, GATHER), tag_of(2, REDUCE), None]
    message = disagreement_message(tags, names.__getitem__)
    assert "ranks [0, 1, 2] at the all-gather of unit 'b' (Lin)" in message
    assert "rank 3 at the reduce of unit 'a' (Lin)" in message
    assert "rank 4 at no further unit collective" in message
    assert "same fully_shard units in the same order" in message


@pytest.mark.parametrize("value", [True, False, "strict"])
def test_check_unit_order_takes_true_false_or_strict(value):
    assert GradPoolConfig(check_unit_order=value).check_unit_order == value


@pytest.mark.parametrize("value", ["Strict", "on", 1, None])
def test_check_unit_order_refuses_anything_else(value):
    with pytest.raises(TypeError, match="check_unit_order must be True, False or 'strict'"):
        GradPoolConfig(check_unit_order=value)


def test_unit_identity_does_not_depend_on_models_built_before():
    """A process that built (and ran) another sharded model first gives the same units the same
    identities as one that did not."""
    from mindspore import Parameter, mint, nn

    from hyper_parallel import fully_shard

    class Lin(nn.Cell):
        def __init__(self, name):
            super().__init__()
            self.w = Parameter(ms.Tensor(np.ones((3, 3), np.float32)), name=f"{name}.w")

        def construct(self, x):
            return mint.matmul(x, self.w)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a, self.b = Lin("a"), Lin("b")

        def construct(self, x):
            return self.b(self.a(x)).sum()

    def build():
        net = Net()
        for layer in (net.a, net.b):
            fully_shard(layer)
        fully_shard(net)
        net(ms.Tensor(np.ones((2, 3), np.float32)))
        return [u.order_identity for u in net._hsdp_units()]   # pylint: disable=protected-access
    first = build()
    extra = Net()           # another model, sharded and run in between
    fully_shard(extra.a)
    fully_shard(extra)
    extra(ms.Tensor(np.ones((2, 3), np.float32)))
    assert build() == first and len(set(first)) == 3
