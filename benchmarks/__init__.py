"""Copy-overhead benchmarks: pytest-benchmark suites (``bench_*.py``) and a runner (``python -m benchmarks``)."""
