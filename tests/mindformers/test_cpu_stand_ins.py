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


# -- the MoE layer's ops (cpu_moe_stand_ins) ------------------------------------------------------
def _np_grouped_matmul(x, w, ends):
    """Row r times the weight of the group it falls in (groups end at the cumulative ``ends``)."""
    group = np.searchsorted(ends, np.arange(len(x)), side="right")
    out = np.zeros((len(x), w.shape[2]))
    for r, g in enumerate(group):
        if g < len(w):
            out[r] = x[r] @ w[g]
    return out


@pytest.mark.parametrize("counts", [[3, 0, 4, 1], [8, 0, 0, 0], [0, 2, 2, 3]])
def test_grouped_matmul_value_and_gradients(counts):
    """GroupedMatmul(split_item=3, group_type=0) as mindformers' GroupedMLP calls it, with empty
    groups and (last case) rows past the last group; the gradients of x and of every expert's
    weight against the NumPy products."""
    from mindspore.ops.auto_generate import GroupedMatmul
    x = RNG.standard_normal((8, 5)).astype(np.float32)
    w = RNG.standard_normal((4, 5, 3)).astype(np.float32)
    up = RNG.standard_normal((8, 3)).astype(np.float32)
    ends = np.cumsum(counts).astype(np.int64)

    def run(xt, wt):
        out = GroupedMatmul(split_item=3, group_type=0)([xt], [wt], None, None, None, None,
                                                        None, ms.Tensor(ends))[0]
        return (out * ms.Tensor(up)).sum(), out

    (_, out), (gx, gw) = ms.value_and_grad(run, (0, 1), has_aux=True)(ms.Tensor(x), ms.Tensor(w))
    np.testing.assert_allclose(out.asnumpy(), _np_grouped_matmul(x, w, ends), rtol=1e-5,
                               atol=1e-6)
    group = np.searchsorted(ends, np.arange(8), side="right")
    want_gx = np.stack([up[r] @ w[g].T if g < 4 else np.zeros(5) for r, g in enumerate(group)])
    want_gw = np.stack([x[group == e].T @ up[group == e] for e in range(4)])
    np.testing.assert_allclose(gx.asnumpy(), want_gx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gw.asnumpy(), want_gw, rtol=1e-5, atol=1e-6)


def test_topk_values_indices_and_gradient():
    x = RNG.standard_normal((5, 6)).astype(np.float32)
    up = RNG.standard_normal((5, 2)).astype(np.float32)
    want_idx = np.argsort(-x, -1, kind="stable")[:, :2]

    def run(xt):
        values, indices = mint.topk(xt, 2, dim=-1, sorted=True)
        return (values * ms.Tensor(up)).sum(), indices

    (_, idx), grad = ms.value_and_grad(run, 0, has_aux=True)(ms.Tensor(x))
    np.testing.assert_array_equal(idx.asnumpy(), want_idx)
    want_grad = np.zeros_like(x)
    np.put_along_axis(want_grad, want_idx, up, -1)
    np.testing.assert_allclose(grad.asnumpy(), want_grad, rtol=1e-6)
    _, unsorted = mint.topk(ms.Tensor(x), 3, dim=-1, sorted=False)
    np.testing.assert_array_equal(np.sort(unsorted.asnumpy(), -1),
                                  np.sort(np.argsort(-x, -1)[:, :3], -1))


def test_histc_argsort_cumsum_floor_divide():
    experts = RNG.integers(0, 4, (6, 2)).astype(np.int64)
    counts = mint.histc(ms.Tensor(experts), bins=4, min=0, max=4)
    np.testing.assert_array_equal(counts.asnumpy(), np.bincount(experts.ravel(), minlength=4))
    values = np.array([1.0, 2.0, 1.0, 0.0, 3.0, 3.5, -1.0], np.float32)   # 3.5, -1 outside
    np.testing.assert_array_equal(mint.histc(ms.Tensor(values), bins=3, min=0, max=3).asnumpy(),
                                  np.histogram(values, bins=3, range=(0, 3))[0])
    ties = np.array([[2, 0, 2, 1, 0, 2], [5, 5, 1, 1, 0, 9]], np.float32)
    np.testing.assert_array_equal(mint.argsort(ms.Tensor(ties), stable=True).asnumpy(),
                                  np.argsort(ties, -1, kind="stable"))
    np.testing.assert_array_equal(mint.argsort(ms.Tensor(ties), dim=0, stable=True).asnumpy(),
                                  np.argsort(ties, 0, kind="stable"))
    np.testing.assert_array_equal(
        mint.argsort(ms.Tensor(ties), descending=True, stable=True).asnumpy(),
        np.argsort(-ties, -1, kind="stable"))
    np.testing.assert_array_equal(
        mint.cumsum(ms.Tensor(experts.ravel()), dim=0, dtype=ms.int64).asnumpy(),
        np.cumsum(experts.ravel()))
    np.testing.assert_array_equal(mint.floor_divide(ms.Tensor(experts), 2).asnumpy(),
                                  experts // 2)


def test_scatter_in_place_masks_selected_groups():
    """The router's group mask: ``ones.scatter_(1, selected, False)`` changes ``mask`` itself."""
    mask = mint.ones_like(ms.Tensor(np.zeros((3, 4), np.float32)), dtype=ms.bool_)
    selected = np.array([[0, 2], [3, 1], [1, 1]], np.int64)
    returned = mask.scatter_(1, ms.Tensor(selected), False)
    want = np.ones((3, 4), bool)
    np.put_along_axis(want, selected, False, 1)
    np.testing.assert_array_equal(mask.asnumpy(), want)
    np.testing.assert_array_equal(returned.asnumpy(), want)


def test_token_permute_unpermute_values_and_gradients():
    """moe_token_permute groups the routing entries by expert (token order within one);
    moe_token_unpermute brings each token's rows back weighted by its probs. Gradients of the
    tokens and the probs through the round trip, against NumPy."""
    tokens = RNG.standard_normal((5, 3)).astype(np.float32)
    experts = np.array([[2, 0], [1, 2], [0, 3], [2, 1], [3, 0]], np.int64)
    probs = RNG.random((5, 2)).astype(np.float32)
    scale = RNG.standard_normal((10, 3)).astype(np.float32)     # per permuted row: no symmetry
    up = RNG.standard_normal((5, 3)).astype(np.float32)
    order = np.argsort(experts.ravel(), kind="stable")
    where = np.argsort(order)                                     # entry i went to row where[i]

    def run(tok, pr):
        permuted, sorted_indices = ops.moe_token_permute(tok, ms.Tensor(experts.astype(np.int32)))
        out = ops.moe_token_unpermute(permuted * ms.Tensor(scale), sorted_indices, pr)
        return (out * ms.Tensor(up)).sum(), (permuted, sorted_indices, out)

    (_, (permuted, sorted_indices, out)), (g_tok, g_probs) = ms.value_and_grad(
        run, (0, 1), has_aux=True)(ms.Tensor(tokens), ms.Tensor(probs))
    np.testing.assert_array_equal(sorted_indices.asnumpy(), where)
    np.testing.assert_allclose(permuted.asnumpy(), tokens[order // 2], rtol=1e-6)
    rows = (tokens[order // 2] * scale)[where].reshape(5, 2, 3)
    np.testing.assert_allclose(out.asnumpy(), (rows * probs[..., None]).sum(1), rtol=1e-5)
    np.testing.assert_allclose(g_probs.asnumpy(), (rows * up[:, None, :]).sum(-1), rtol=1e-5)
    want_tok = np.zeros_like(tokens)
    for i in range(10):
        token, k = divmod(i, 2)
        want_tok[token] += probs[token, k] * scale[where[i]] * up[token]
    np.testing.assert_allclose(g_tok.asnumpy(), want_tok, rtol=1e-5, atol=1e-6)
