"""The CPU host path: a CPU pool's buckets written through their own host memory.

:mod:`~gradpool.host.kernels` (the compiled loops, no MindSpore), :mod:`~gradpool.host.views`
(a tensor's memory as NumPy arrays, the casts into it), :mod:`~gradpool.host.writer` (the bucket
writer of CPU pools). Above ``gradpool.pack``, whose checks and chunk geometry it shares, and below
``gradpool.writers``; the pool knows nothing of it (``tests/test_architecture.py``).
"""
