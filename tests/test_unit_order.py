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


def test_each_unit_collective_agrees_on_its_own_kind():
    """One step at world size 1 with the agreement recorded: every unit's reduce agrees as a
    reduce (once per unit and step) and every gather as a gather, so ranks at the same unit but
    different collectives disagree, and the message names the collective each rank ran."""
    import mindspore as ms
    import numpy as np
    from mindspore import Parameter, mint, nn

    from gradpool import GradPoolConfig
    from hyper_parallel import fully_shard

    class Lin(nn.Cell):
        def __init__(self, seed):
            super().__init__()
            w = np.random.default_rng(seed).standard_normal((3, 3)).astype(np.float32)
            self.w = Parameter(ms.Tensor(w), name=f"w{seed}")

        def construct(self, x):
            return mint.tanh(mint.matmul(x, self.w))

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.a, self.b = Lin(1), Lin(2)

        def construct(self, x):
            return self.b(self.a(x)).sum()

    net = Net()
    config = GradPoolConfig(check_unit_order=True)
    for layer in (net.a, net.b):
        fully_shard(layer, pool_config=config)
    fully_shard(net, pool_config=config)
    seen = []
    for unit in net._hsdp_units():                  # pylint: disable=protected-access
        def recording(kind, unit=unit):
            seen.append((unit.index, kind, "reduce" if reducing[0] else "gather"))
        unit._agree = recording                     # pylint: disable=protected-access
        unit.memory._agree = recording              # pylint: disable=protected-access
        unit.reduce_path._agree = recording         # pylint: disable=protected-access
        original = unit.reduce_path.reduce

        def reduce(params, op, original=original):
            reducing[0] = True
            try:
                return original(params, op)
            finally:
                reducing[0] = False
        unit.reduce_path.reduce = reduce
    reducing = [False]
    ms.value_and_grad(net, None, net.trainable_params())(ms.Tensor(np.ones((2, 3), np.float32)))
    assert [kind for _, kind, doing in seen if doing == "reduce"] == [REDUCE] * 2
    assert {kind for _, kind, doing in seen if doing == "gather"} == {GATHER}
    assert sorted(index for index, kind, _ in seen if kind == REDUCE) == sorted(
        u.index for u in net._hsdp_units() if u.params)   # pylint: disable=protected-access
