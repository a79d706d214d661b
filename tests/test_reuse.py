"""gradpool.reuse: which free bucket a request reuses, in both its forms, against a brute-force
reference (pure Python, no MindSpore: the pool and the memory plan's replay both use it)."""
from dataclasses import dataclass

from hypothesis import given, settings, strategies as st

from gradpool.reuse import FREE, FreeIndex, choose


@dataclass(eq=False)
class Record:
    capacity: int
    dtype: str
    state: str = FREE


def reference(records, numel, dtype):
    """The rule as written: of the free records of ``dtype`` holding ``numel``, the smallest,
    the first allocated of equals."""
    fits = [(r.capacity, position) for position, r in enumerate(records)
            if r.state == FREE and r.dtype == dtype and r.capacity >= numel]
    return records[min(fits)[1]] if fits else None


def twin(name: str) -> str:
    """An equal string that is another object: the rule compares dtypes by ``==``, not only
    identity (``is``)."""
    return "".join(list(name))


DTYPES = ["float32", "bfloat16"]
capacities = st.integers(1, 6)            # few values: many capacity ties


def test_the_smallest_that_holds_the_request_and_the_first_allocated_of_equals():
    records = [Record(8, "float32"), Record(4, "float32"), Record(4, "float32"),
               Record(2, "float32"), Record(4, "bfloat16")]
    assert choose(records, 3, "float32") is records[1]
    assert choose(records, 2, "float32") is records[3]
    records[1].state = "fenced"
    assert choose(records, 3, "float32") is records[2]
    assert choose(records, 5, "float32") is records[0]
    assert choose(records, 9, "float32") is None
    assert choose(records, 1, "float16") is None
    assert choose(records, 4, twin("bfloat16")) is records[4]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(capacities, st.sampled_from(DTYPES),
                          st.sampled_from([FREE, "leased", "fenced"])), max_size=12),
       capacities, st.sampled_from(DTYPES), st.booleans())
def test_choose_is_the_reference(rows, numel, dtype, twinned):
    records = [Record(c, d, s) for c, d, s in rows]
    request = twin(dtype) if twinned else dtype
    assert choose(records, numel, request) is reference(records, numel, request)


# One step of a pool's life: allocate a free bucket, take one for a request (leasing it when
# there is one), or give the i-th leased one back.
steps = st.lists(st.one_of(
    st.tuples(st.just("allocate"), capacities, st.sampled_from(DTYPES)),
    st.tuples(st.just("take"), capacities, st.sampled_from(DTYPES)),
    st.tuples(st.just("release"), st.integers(0, 20), st.just(None))), max_size=60)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_index_takes_what_choose_and_the_reference_pick(history):
    records, index = [], FreeIndex()
    leased = []
    for op, value, dtype in history:
        if op == "allocate":
            records.append(Record(value, dtype))
            index.add(records[-1], len(records) - 1)
        elif op == "take":
            want = reference(records, value, dtype)
            assert choose(records, value, dtype) is want
            assert index.take(value, dtype) is want
            if want is not None:
                want.state = "leased"
                leased.append(want)
        elif leased:
            back = leased.pop(value % len(leased))
            back.state = FREE
            index.add(back, records.index(back))
    for dtype in DTYPES:           # what is left comes out in the rule's order
        while (want := reference(records, 1, dtype)) is not None:
            assert index.take(1, dtype) is want
            want.state = "leased"
        assert index.take(1, dtype) is None
