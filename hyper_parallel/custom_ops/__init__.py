"""NPU custom ops (not provided: see :mod:`hyper_parallel.custom_ops.experimental`)."""
