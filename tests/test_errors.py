"""gradpool.errors: every refusal at the public boundary is a typed error, a subclass of the
matching builtin, that names the value. The bad-input matrix that holds the modules to it
(tests/bad_inputs.py: one table per module, each run by that module's test file) spans the public
surface."""
from bad_inputs import CASES


def test_the_matrix_has_at_least_sixty_distinct_bad_inputs():
    assert len(CASES) >= 60
