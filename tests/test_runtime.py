"""gradpool.runtime: GradPoolConfig refuses bad input with a typed error naming the value, before
anything is built (its table of the bad-input matrix, tests/bad_inputs.py)."""
import pytest

from bad_inputs import RUNTIME_CASES, assert_refused_typed


@pytest.mark.parametrize("name", sorted(RUNTIME_CASES))
def test_bad_input_is_refused_typed_naming_the_value(name):
    assert_refused_typed(name)
