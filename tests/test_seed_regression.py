"""The seed bug: a reduce path freed the caller's gradient with untyped_storage().resize_(0).

Part 1 pins MindSpore's aliasing (so an upgrade that changes it is noticed). Part 2 proves the
pool's path cannot free or change the caller's gradient for any dtype pair.
"""
import itertools

import mindspore as ms
import numpy as np
import pytest

from gradpool import writers
from gradpool.layout import ReduceScatterLayout
from gradpool.pool import BucketPool
from npref import raw_bytes, storage_bytes

ms.set_device("CPU")
DTYPES = [ms.float32, ms.float16, ms.bfloat16]


def storage_freed_by_seed_pattern(make_comm_buffer):
    """The upstream pattern: free the communication input after the collective."""
    grad = ms.Tensor(np.arange(16, dtype=np.float32).reshape(4, 4))
    comm_buf = make_comm_buffer(grad)
    comm_buf.untyped_storage().resize_(0)
    return storage_bytes(grad) == 0


@pytest.mark.parametrize("make, freed", [
    (lambda g: g.to(ms.float32), True),               # same dtype: .to() aliases
    (lambda g: g.to(ms.float32).reshape(-1), True),   # ... and so does reshape
    (lambda g: g.to(ms.bfloat16), False),             # a real cast copies
], ids=["to-same-dtype", "to-then-reshape", "to-other-dtype"])
def test_mindspore_aliasing_that_caused_the_seed_bug(make, freed):
    assert storage_freed_by_seed_pattern(make) is freed


@pytest.mark.parametrize("grad_dtype, reduce_dtype", list(itertools.product(DTYPES, DTYPES)),
                         ids=lambda d: str(d))
@pytest.mark.parametrize("shape", [(12,), (4, 6), (5, 3)], ids=["1d", "2d", "odd-dim0"])
def test_pool_path_never_frees_or_changes_the_gradient(grad_dtype, reduce_dtype, shape):
    pool = BucketPool(poison_on_release=True)
    rng = np.random.default_rng(7)
    grad = ms.Tensor(rng.standard_normal(shape).astype(np.float32)).astype(grad_dtype)
    # The upstream aliasing: what the seed code would have handed to the collective.
    alias = grad.to(reduce_dtype).reshape(-1)
    size_before, bytes_before = storage_bytes(grad), raw_bytes(grad)
    assert size_before > 0

    layout = ReduceScatterLayout.build([shape], world_size=2, alignment=16)
    lease = pool.acquire(layout.total_numel, reduce_dtype)
    writers.pack(lease, [alias.reshape(shape)], layout, host=True)
    lease.release()

    reused = pool.acquire(layout.total_numel, reduce_dtype)   # the same bucket, overwritten
    writers.pack(reused, [ms.Tensor(np.full(shape, 9.0, np.float32))], layout, host=True)
    reused.release()
    pool.trim()

    assert pool.stats().new_allocations == 1 and pool.stats().bytes_reserved == 0
    assert storage_bytes(grad) == size_before
    assert raw_bytes(grad) == bytes_before
    assert storage_bytes(alias) > 0   # the aliasing view the seed code freed is intact too
