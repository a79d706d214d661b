"""The tiny DeepSeek-V3-shaped model: finite loss, per-parameter grads, determinism, training."""
import dataclasses
import math

import mindspore as ms
import numpy as np
import pytest

from gradpool.app.model import TinyDeepSeekV3, global_batch_np, make_batch, make_batch_np
from gradpool.app.config import ModelConfig
from gradpool.errors import InvalidArgumentError

ms.set_device("CPU")
CFG = ModelConfig()  # vocab 67, hidden 32, 2 layers, 4 experts top-2
SEED = 1234


@pytest.fixture(scope="module")
def model():
    return TinyDeepSeekV3(CFG, seed=SEED)


@pytest.fixture(scope="module")
def tokens():
    return make_batch(CFG, step=0)


@pytest.fixture(scope="module")
def loss_and_grads(model, tokens):
    params = model.trainable_params()
    loss, grads = ms.value_and_grad(lambda: model.loss(tokens), None, params)()
    return float(loss), grads


def arrays(model):
    return {p.name: p.asnumpy().copy() for p in model.trainable_params()}


def test_forward_gives_a_finite_loss_near_uniform(model, tokens):
    logits = model(tokens[:, :-1])
    assert logits.shape == (CFG.batch_size, CFG.seq_len, CFG.vocab_size)
    loss = float(model.loss(tokens))
    assert math.isfinite(loss)
    # Small init: predictions start near uniform over the vocabulary.
    assert abs(loss - math.log(CFG.vocab_size)) < 1.0


def test_one_finite_gradient_per_parameter_with_its_shape(model, loss_and_grads):
    params = model.trainable_params()
    _, grads = loss_and_grads
    assert len(grads) == len(params)
    for param, grad in zip(params, grads):
        assert grad.shape == param.shape, param.name
        assert grad.dtype == param.dtype == ms.float32, param.name
        values = grad.asnumpy()
        assert np.isfinite(values).all(), param.name
        # Every parameter is used, and with 32 tokens choosing 2 of 4 experts every expert is
        # routed to at least once for this seed, so no gradient is identically zero.
        assert np.abs(values).sum() > 0, param.name


def test_gradients_match_a_finite_difference(loss_and_grads, tokens):
    """Directional derivative along a random direction: checks every op's backward on CPU."""
    loss0, grads = loss_and_grads
    rng = np.random.default_rng(7)
    base = TinyDeepSeekV3(CFG, seed=SEED)
    direction = [rng.standard_normal(p.shape).astype(np.float32) for p in base.trainable_params()]
    predicted = sum(float((g.asnumpy() * d).sum()) for g, d in zip(grads, direction))
    eps = 1e-3

    def loss_at(scale):
        shifted = TinyDeepSeekV3(CFG, seed=SEED)
        for param, d in zip(shifted.trainable_params(), direction):
            param.set_data(ms.Tensor(param.asnumpy() + scale * eps * d))
        return float(shifted.loss(tokens))

    measured = (loss_at(1.0) - loss_at(-1.0)) / (2 * eps)
    assert measured == pytest.approx(predicted, rel=2e-2, abs=1e-3)


def test_parameters_have_unique_names_and_an_odd_dim0(model):
    params = model.trainable_params()
    names = [p.name for p in params]
    assert len(set(names)) == len(names)
    assert {"embed", "head", "layers.0.attn.q", "layers.1.moe.experts.3.down",
            "layers.0.moe.router", "final_norm.weight"} <= set(names)
    odd = [p.name for p in params if p.shape[0] % 2 == 1]
    assert "embed" in odd and "head" in odd
    assert all(p.dtype == ms.float32 for p in params)


def test_same_seed_same_model_and_loss(model, tokens):
    twin = TinyDeepSeekV3(CFG, seed=SEED)
    ours, theirs = arrays(model), arrays(twin)
    assert list(ours) == list(theirs)
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    assert float(twin.loss(tokens)) == float(model.loss(tokens))
    other = arrays(TinyDeepSeekV3(CFG, seed=SEED + 1))
    assert not np.array_equal(other["embed"], ours["embed"])


def test_three_adam_steps_reduce_the_loss_on_a_fixed_batch(tokens):
    model = TinyDeepSeekV3(CFG, seed=SEED)
    params = model.trainable_params()
    before = arrays(model)
    step = ms.value_and_grad(lambda: model.loss(tokens), None, params)
    optimizer = ms.nn.Adam(params, learning_rate=1e-2)
    losses = []
    for _ in range(3):
        loss, grads = step()
        losses.append(float(loss))
        optimizer(grads)
    losses.append(float(model.loss(tokens)))
    assert losses[-1] < losses[0] and all(b < a for a, b in zip(losses, losses[1:])), losses
    # The optimizer really wrote the Parameters (CPU has in-place ops that silently do nothing).
    after = arrays(model)
    assert all(not np.array_equal(before[n], after[n]) for n in before)


def test_routing_picks_exactly_k_experts_with_weights_summing_to_one(model):
    moe = model.layers[0].moe
    x = ms.Tensor(np.random.default_rng(3).standard_normal((10, CFG.hidden_size)), ms.float32)
    weights = moe.routing_weights(x).asnumpy()
    assert weights.shape == (10, CFG.num_experts)
    assert ((weights > 0).sum(axis=-1) == CFG.experts_per_token).all()
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, rtol=1e-6)


def test_batched_moe_equals_the_per_expert_loop(model):
    moe = model.layers[1].moe
    x = ms.Tensor(np.random.default_rng(4).standard_normal((2, 5, CFG.hidden_size)), ms.float32)
    weights = moe.routing_weights(x).asnumpy()
    reference = sum(weights[..., e:e + 1] * expert(x).asnumpy()
                    for e, expert in enumerate(moe.experts))
    np.testing.assert_allclose(moe(x).asnumpy(), reference, rtol=1e-5, atol=1e-6)


def test_attention_is_causal(model):
    """Changing a later token must not change earlier positions' logits."""
    tokens = make_batch_np(CFG, 0)[:, :-1]
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % CFG.vocab_size
    a = model(ms.Tensor(tokens)).asnumpy()
    b = model(ms.Tensor(changed)).asnumpy()
    np.testing.assert_array_equal(a[:, :-1], b[:, :-1])
    assert not np.array_equal(a[:, -1], b[:, -1])


# ---- data ------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
def test_rank_batches_concatenate_to_the_single_process_batch(world):
    whole = dataclasses.replace(CFG, batch_size=world * CFG.batch_size)
    for step in (0, 5):
        ranks = [make_batch_np(CFG, step, rank, world, seed=SEED) for rank in range(world)]
        single = make_batch_np(whole, step, 0, 1, seed=SEED)
        np.testing.assert_array_equal(np.concatenate(ranks), single)
        np.testing.assert_array_equal(global_batch_np(CFG, step, world, seed=SEED), single)


def test_batches_are_deterministic_valid_token_ids():
    a = make_batch(CFG, 3, 1, 2, seed=SEED).asnumpy()
    b = make_batch(CFG, 3, 1, 2, seed=SEED).asnumpy()
    np.testing.assert_array_equal(a, b)
    assert a.shape == (CFG.batch_size, CFG.seq_len + 1) and a.dtype == np.int32
    assert a.min() >= 0 and a.max() < CFG.vocab_size
    assert not np.array_equal(a, make_batch_np(CFG, 4, 1, 2, seed=SEED))
    assert not np.array_equal(a, make_batch_np(CFG, 3, 0, 2, seed=SEED))
    assert not np.array_equal(a, make_batch_np(CFG, 3, 1, 2, seed=SEED + 1))


@pytest.mark.parametrize("kwargs, fragment", [
    ({"rank": 2, "world": 2}, "rank must be an integer in [0, 2)"),
    ({"rank": -1, "world": 2}, "rank must be"),
    ({"rank": 0, "world": 0}, "world must be an integer >= 1"),
    ({"step": -1}, "step must be an integer >= 0"),
])
def test_make_batch_rejects_bad_rank_world_step(kwargs, fragment):
    args = {"step": 0, "rank": 0, "world": 1, **kwargs}
    with pytest.raises(InvalidArgumentError) as info:
        make_batch_np(CFG, **args)
    assert fragment in str(info.value)


def test_model_needs_a_model_config():
    with pytest.raises(InvalidArgumentError, match="ModelConfig"):
        TinyDeepSeekV3({"vocab_size": 67})
