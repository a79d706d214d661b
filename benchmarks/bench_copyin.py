"""Copy-in: pool pack against zero-copy borrow, upstream-style fresh allocation and NumPy memcpy.

Ratios (speed relative to memcpy of the bytes written, to a fresh allocation, to one small op per
gradient) are printed at the end of the run by ``benchmarks/conftest.py``; nothing here asserts a
speed. After timing, each case checks its result on new data against NumPy (``run.check()``), so
a copy that writes nothing fails here, also in the ``--benchmark-disable`` smoke run.
"""
import mindspore as ms

from benchmarks.cases import COPY_SIZES, MIB, SMALL_COUNT, copy_cases, make_copy, make_small_op

ms.set_device("CPU")

# The smoke run (--benchmark-disable, what `make test` runs) leaves out the 256 MiB cases: the
# 64 MiB cases take every pair's streaming path too wherever the last-level cache share is at
# most 96 MiB (both stream from a third of it, written: gradpool.host.caches), and the 256 MiB
# cases were 45 s of the smoke run's 75 s on 2 cores.
# Timed runs keep every size.
SMOKE_SIZES = tuple(size for size in COPY_SIZES if size <= 64 * MIB)


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        smoke = metafunc.config.getoption("benchmark_disable", default=False)
        cases = copy_cases(sizes=SMOKE_SIZES if smoke else COPY_SIZES)
        metafunc.parametrize("case", cases, ids=[c.name for c in cases])


def test_copy_in(benchmark, case):
    run = make_copy(case)
    benchmark.group = f"copy {case.grad_dtype}->{case.bucket_dtype} " + \
        (f"{case.count}x{case.nbytes // case.count}B" if case.count > 1 else f"{case.nbytes}B")
    benchmark.extra_info.update(method=case.method, nbytes=case.nbytes, count=case.count,
                                grad_dtype=case.grad_dtype, bucket_dtype=case.bucket_dtype)
    benchmark(run)
    run.check()
    pool = getattr(run, "pool", None)
    if pool is not None:
        stats = pool.stats()
        benchmark.extra_info["new_allocations"] = stats.new_allocations
        assert stats.live_leases == 0


def test_small_op_reference(benchmark):
    benchmark.group = "small op"
    benchmark.extra_info.update(method="small_op", count=SMALL_COUNT)
    benchmark(make_small_op())
