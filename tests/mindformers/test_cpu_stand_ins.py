"""The CPU stand-ins of tests/mindformers compute what the MindSpore ops they replace compute
(NumPy references): a wrong stand-in would be invisible to the sharded-vs-unsharded comparisons,
which run it on both sides."""
import numpy as np
import pytest

import cpu_stand_ins

cpu_stand_ins.install()

import mindspore as ms          # noqa: E402
from mindspore import mint, ops  # noqa: E402

RNG = np.random.default_rng(3)


def _np_attention(q, k, v, masked, scale):
    scores = np.einsum("bnsd,bntd->bnst", q, k) * scale
    scores = np.where(masked, -np.inf, scores)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnst,bntd->bnsd", probs, v)


@pytest.mark.parametrize("layout", ["BNSD", "BSH", "SBH"])
def test_flash_attention_stand_in_is_masked_softmax_attention(layout):
    b, n, s, d = 2, 3, 5, 4
    q, k, v = (RNG.standard_normal((b, n, s, d)).astype(np.float32) for _ in range(3))
    causal = np.triu(np.ones((s, s), np.uint8), 1)[None, None]       # 1 = masked out
    to_layout = {"BNSD": lambda x: x,
                 "BSH": lambda x: x.transpose(0, 2, 1, 3).reshape(b, s, n * d),
                 "SBH": lambda x: x.transpose(2, 0, 1, 3).reshape(s, b, n * d)}[layout]
    attention = cpu_stand_ins.CpuFlashAttentionScore(head_num=n, scale_value=0.5,
                                                     input_layout=layout)
    *_, out = attention(ms.Tensor(to_layout(q)), ms.Tensor(to_layout(k)),
                        ms.Tensor(to_layout(v)), attn_mask=ms.Tensor(causal))
    expected = to_layout(_np_attention(q, k, v, causal.astype(bool), 0.5))
    np.testing.assert_allclose(out.asnumpy(), expected, rtol=1e-5, atol=1e-6)


def test_split_then_cat_has_the_right_gradient():
    """RoPE's rotate-half: cat(-second, first) of a split; its gradient w.r.t. x is the same
    permutation, negated on one half, applied to the upstream gradient."""
    x = ms.Tensor(RNG.standard_normal((3, 8)).astype(np.float32))
    up = RNG.standard_normal((3, 8)).astype(np.float32)

    def rotate_half(t):
        first, second = mint.split(t, 4, -1)
        return (mint.cat((-second, first), -1) * ms.Tensor(up)).sum()

    grad = ms.grad(rotate_half)(x).asnumpy()
    np.testing.assert_allclose(grad, np.concatenate([up[:, 4:], -up[:, :4]], -1), rtol=1e-6)


def test_rms_norm_swiglu_addcmul_scatter_add():
    x = RNG.standard_normal((4, 6)).astype(np.float32)
    w = RNG.standard_normal(6).astype(np.float32)
    y, rstd = ops.rms_norm(ms.Tensor(x), ms.Tensor(w), 1e-6)
    want_rstd = 1 / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y.asnumpy(), x * want_rstd * w, rtol=1e-5)
    np.testing.assert_allclose(rstd.asnumpy(), want_rstd, rtol=1e-5)
    a, g = x[:, :3], x[:, 3:]
    np.testing.assert_allclose(ops.swiglu(ms.Tensor(x), -1).asnumpy(),
                               a / (1 + np.exp(-a)) * g, rtol=1e-5)
    np.testing.assert_allclose(mint.addcmul(ms.Tensor(x), ms.Tensor(x), ms.Tensor(x),
                                            value=0.5).asnumpy(), x + 0.5 * x * x, rtol=1e-6)
    index = np.array([[0, 2], [1, 1]], np.int64)
    src = np.ones((2, 2), np.float32)
    expected = np.zeros((2, 3), np.float32)
    np.add.at(expected, (np.arange(2)[:, None], index), src)
    np.testing.assert_allclose(mint.scatter_add(ms.Tensor(np.zeros((2, 3), np.float32)), 1,
                                                ms.Tensor(index), ms.Tensor(src)).asnumpy(),
                               expected)
