"""``clip_grad_norm_`` over 1,000 gradients of 4,096 float32 elements (max_norm above the norm:
the coefficient is 1, but the multiply runs, since whether to clip is known only on the device),
on one process. Reports host synchronisations per call (reads of a tensor's value to the host,
counted: none, the norm stays on the device) in extra_info; asserts the value against NumPy's
norm."""
import math

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter

from hyper_parallel import clip_grad_norm_

ms.set_device("CPU")
COUNT, NUMEL = 1000, 4096


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["2-norm", "inf-norm"])
def test_clip_grad_norm(benchmark, monkeypatch, norm_type):
    rng = np.random.default_rng(0)
    values = [rng.standard_normal(NUMEL).astype(np.float32) for _ in range(COUNT)]
    params = [Parameter(ms.Tensor(np.zeros(NUMEL, np.float32)), name=f"p{i}")
              for i in range(COUNT)]
    grads = [ms.Tensor(v) for v in values]
    reads = []
    real = ms.Tensor.asnumpy
    monkeypatch.setattr(ms.Tensor, "asnumpy", lambda self: reads.append(1) or real(self))
    norm = clip_grad_norm_(params, 1e9, norm_type=norm_type, grads=grads)
    syncs_per_call = len(reads)
    monkeypatch.undo()
    benchmark.group = "clip_grad_norm_ 1000 x 4096 float32"
    benchmark.extra_info.update(parameters=COUNT, numel=NUMEL, host_syncs_per_call=syncs_per_call)
    benchmark(clip_grad_norm_, params, 1e9, norm_type, grads=grads)
    flat = np.concatenate(values).astype(np.float64)
    want = np.abs(flat).max() if math.isinf(norm_type) else np.linalg.norm(flat)
    np.testing.assert_allclose(float(norm.asnumpy()), want, rtol=1e-5)
    assert syncs_per_call == 0
