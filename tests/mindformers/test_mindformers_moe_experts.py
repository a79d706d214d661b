"""mindformers' own MoE experts (``GroupedMLP``, built by its model builder for the tiny
DeepSeek-V3 MoE model) on CPU through the stand-ins, against a NumPy MoE: each token's output is
the sum over its top-k experts of ``prob * (silu(a) * b) @ w2[e]`` with ``[a, b] = x @ w1[e]``;
and the gradients of the tokens, the probs and both expert weights. Both token permutations
mindformers has run: its own (``argsort``, indexing; the DeepSeek-V3 default) and the fused one
(``moe_permute_fusion: True``: ``ops.moe_token_permute`` / ``moe_token_unpermute``).

The training cases (mf_cases.py) compare the sharded model with the unsharded one, both on the
stand-ins; this is where the MoE computation itself is checked."""
import numpy as np
import pytest

import mf_flow

import mindspore as ms      # noqa: E402

RNG = np.random.default_rng(11)
SEQ, BATCH = 5, 2           # 10 tokens
TOP_K = mf_flow.DEEPSEEK3_MOE_TINY["num_experts_per_tok"]
EXPERTS = mf_flow.DEEPSEEK3_MOE_TINY["n_routed_experts"]


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _numpy_experts(x, probs, chosen, w1, w2, up):
    """Output and gradients (x, probs, w1, w2) of ``sum(out * up)``."""
    ffn = w2.shape[1]
    out = np.zeros((len(x), w2.shape[2]))
    g_x, g_p = np.zeros_like(x), np.zeros_like(probs)
    g_w1, g_w2 = np.zeros_like(w1), np.zeros_like(w2)
    for n in range(len(x)):
        for k, e in enumerate(chosen[n]):
            h = x[n] @ w1[e]
            a, b = h[:ffn], h[ffn:]
            s = _sigmoid(a)
            act = a * s * b
            y = act @ w2[e]
            out[n] += probs[n, k] * y
            g_p[n, k] += up[n] @ y
            g_y = probs[n, k] * up[n]
            g_w2[e] += np.outer(act, g_y)
            g_act = w2[e] @ g_y
            g_h = np.concatenate([g_act * b * (s + a * s * (1 - s)), g_act * a * s])
            g_w1[e] += np.outer(x[n], g_h)
            g_x[n] += w1[e] @ g_h
    return out, (g_x, g_p, g_w1, g_w2)


def _experts(fusion: bool):
    model_cfg = dict(mf_flow.DEEPSEEK3_MOE_TINY, moe_permute_fusion=fusion)
    model = mf_flow.build_on_meta(mf_flow.train_config(model_cfg))
    mf_flow.materialize(model)
    experts = model.model.decoder.layers[1].mlp.experts
    assert (type(experts).__name__, experts.moe_permute_fusion) == ("GroupedMLP", fusion)
    return experts


@pytest.mark.parametrize("fusion", [False, True], ids=["argsort_permute", "fused_permute"])
def test_grouped_mlp_is_a_mixture_of_swiglu_experts(fusion):
    experts = _experts(fusion)
    hidden = experts.hidden_size
    w1 = (RNG.standard_normal(experts.weight1.shape) * 0.3).astype(np.float32)
    w2 = (RNG.standard_normal(experts.weight2.shape) * 0.3).astype(np.float32)
    experts.weight1.set_data(ms.Tensor(w1))
    experts.weight2.set_data(ms.Tensor(w2))
    x = RNG.standard_normal((SEQ, BATCH, hidden)).astype(np.float32)
    # Distinct experts per token; experts 6 and 7 get no token (empty groups).
    chosen = np.stack([RNG.choice(EXPERTS - 2, TOP_K, replace=False)
                       for _ in range(SEQ * BATCH)]).astype(np.int64)
    probs = RNG.random((SEQ * BATCH, TOP_K)).astype(np.float32)
    counts = np.bincount(chosen.ravel(), minlength=EXPERTS).astype(np.int32)
    up = RNG.standard_normal((SEQ * BATCH, hidden)).astype(np.float32)

    def run(tokens, p, weight1, weight2):
        out = experts(tokens, p, ms.Tensor(chosen), ms.Tensor(counts))
        return (out * ms.Tensor(up)).sum(), out

    grad_fn = ms.value_and_grad(run, (0, 1), [experts.weight1, experts.weight2], has_aux=True)
    (_, out), (inputs, weights) = grad_fn(ms.Tensor(x), ms.Tensor(probs), experts.weight1,
                                          experts.weight2)
    want, (g_x, g_p, g_w1, g_w2) = _numpy_experts(
        x.reshape(-1, hidden).astype(np.float64), probs.astype(np.float64), chosen, w1, w2, up)
    close = dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out.asnumpy(), want, **close)
    np.testing.assert_allclose(inputs[0].asnumpy().reshape(-1, hidden), g_x, **close)
    np.testing.assert_allclose(inputs[1].asnumpy(), g_p, **close)
    np.testing.assert_allclose(weights[0].asnumpy(), g_w1, **close)
    np.testing.assert_allclose(weights[1].asnumpy(), g_w2, **close)
    assert not np.any(weights[0].asnumpy()[EXPERTS - 2:])     # no token, no gradient
