"""Reduce step at world size 1: the whole reduce path for the tiny model's gradients, pool (copy)
against zero-copy (borrow), comm_fusion off and on. The N-rank version runs under msrun in the
runner (``python -m benchmarks run --nproc N``). Nothing here asserts a speed; it does assert
that a warmed-up pool allocates nothing and that the shards are NumPy's average."""
import mindspore as ms
import pytest

from benchmarks.cases import make_reduce_step, reduce_cases
from gradpool.comm import SingleProcessCommunicator

ms.set_device("CPU")


@pytest.mark.parametrize("case", reduce_cases(world_size=1), ids=lambda c: c.name)
def test_reduce_step(benchmark, case):
    run = make_reduce_step(case, SingleProcessCommunicator())
    run()                                   # first step: the pool allocates its buckets
    first = run.pool.stats().new_allocations
    benchmark.group = f"reduce step w1 {'fused' if case.comm_fusion else 'per-grad'}"
    benchmark.extra_info.update(method=case.method, comm_fusion=case.comm_fusion,
                                world_size=1, gradients=run.gradients)
    benchmark(run)
    stats = run.pool.stats()
    benchmark.extra_info.update(new_allocations_after_first=stats.new_allocations - first,
                                high_water_bytes=stats.high_water_bytes,
                                borrows=run.reducer.borrows)
    run.check()                             # shards of new gradients against NumPy's average
    assert stats.new_allocations == first
    assert stats.live_leases == 0
    if case.method == "zero_copy" and not case.comm_fusion:
        assert run.reducer.borrows > 0      # world 1: every layout is the identity
