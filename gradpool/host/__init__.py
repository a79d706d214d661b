"""The CPU host path: a CPU pool's buckets written through their own host memory.

* :mod:`gradpool.host.kernels`: the compiled loops (numba; NumPy only, no MindSpore);
* :mod:`gradpool.host.views`: a tensor's memory as NumPy arrays, the casts into it;
* :mod:`gradpool.host.writer`: :class:`~gradpool.host.writer.HostWriter`, the bucket writer of
  CPU pools, which :func:`gradpool.writers.writer_for` chooses.

It sits above ``gradpool.pack`` (whose checks and chunk geometry it shares) and below
``gradpool.writers``; the pool knows nothing of it (``tests/test_architecture.py``).
"""
