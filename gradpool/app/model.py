"""A tiny DeepSeek-V3-shaped model (attention + routed MoE), float32, for end-to-end FSDP runs.

Why this shape: it has the parameter kinds whose gradients the reduce path must handle in the
field: an embedding and an output head with an odd dim 0 (vocab 67, so dim-0 shards are uneven),
square projections, a small router matrix, many small expert matrices, and 1-D norm weights.

Layout of one layer (pre-norm residual, like DeepSeek-V3 without MLA or shared experts)::

    h = x + Attention(RMSNorm(x))          causal softmax attention, q/k/v/o projections
    y = h + MoE(RMSNorm(h))                top-k routed SwiGLU experts

With ``model.expert_parallel = 1`` the MoE is computed densely: every expert runs on every token
and its output is weighted by the routing weight, which is zero for experts outside the token's
top-k. Wasteful, but it has no data-dependent shapes, so it is deterministic and every expert
receives a gradient every step (a zero one where unrouted); it is the reference the
expert-parallel model is checked against. With ``expert_parallel = E > 1`` each rank holds
``num_experts / E`` experts of each layer and computes them sparsely, only on the tokens routed
to them, through a token dispatcher (:mod:`gradpool.app.moe`).

Ops: MindSpore 2.10 PyNative on CPU lacks kernels for several ``mint`` ops this model would
naturally use (``mint.topk``, ``mint.nn.functional.one_hot/embedding/cross_entropy/log_softmax``,
``mint.index_select``, ``mint.tril``, ``mint.stack``, ``mint.arange``, ``mint.logsumexp``: each
raises "The kernel ... unregistered"), so those few are taken from ``mindspore.ops``, which has
CPU kernels; the rest is ``mint``. ``tests/test_model.py`` runs every op here forward and
backward on CPU. Nothing here writes into a tensor in place.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, mint, nn, ops

from gradpool.app.config import ModelConfig
from gradpool.app.moe import ExpertParallel, LocalExperts, dispatcher_for, local_experts
from gradpool.errors import InvalidArgumentError

RMS_EPS = 1e-6
# Additive attention / routing mask. Finite rather than -inf: a -inf row would give NaN in
# softmax; causal rows always keep the diagonal, so -1e9 still gives exact zeros.
MASKED = -1e9
# Token stream rule (see make_batch): next = (MULT * prev + INC) % vocab with prob FOLLOW_PROB.
MULT, INC, FOLLOW_PROB = 5, 3, 0.75


def _normal(rng: np.random.Generator, shape, std: float) -> Parameter:
    """A float32 Parameter drawn from ``rng``; Cell attribute assignment gives it its name."""
    return Parameter(Tensor((rng.standard_normal(shape) * std).astype(np.float32)))


def _ones(size: int) -> Parameter:
    return Parameter(Tensor(np.ones(size, np.float32)))


class RMSNorm(nn.Cell):
    """x / rms(x) * weight over the last dim."""

    def __init__(self, size: int):
        super().__init__()
        self.weight = _ones(size)

    def construct(self, x: Tensor) -> Tensor:
        inv_rms = mint.rsqrt(mint.mean(x * x, dim=-1, keepdim=True) + RMS_EPS)
        return x * inv_rms * self.weight


class Attention(nn.Cell):
    """Multi-head causal softmax attention; weights stored (in, out) and applied as x @ W."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_dim = hidden // cfg.num_heads
        std = hidden ** -0.5  # keeps activations O(1) through each projection
        self.q = _normal(rng, (hidden, hidden), std)
        self.k = _normal(rng, (hidden, hidden), std)
        self.v = _normal(rng, (hidden, hidden), std)
        self.o = _normal(rng, (hidden, hidden), std / math.sqrt(2 * cfg.num_layers))
        self._masks: Dict[int, Tensor] = {}

    def _causal_mask(self, length: int, dtype) -> Tensor:
        # Built once per length in numpy (mint.tril has no CPU kernel) and cached.
        if length not in self._masks:
            upper = np.triu(np.ones((length, length), dtype=bool), k=1)
            self._masks[length] = Tensor(np.where(upper, MASKED, 0.0).astype(np.float32))
        return self._masks[length].astype(dtype)

    def _split_heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return mint.permute(x.reshape(batch, length, self.num_heads, self.head_dim), (0, 2, 1, 3))

    def construct(self, x: Tensor) -> Tensor:
        batch, length, hidden = x.shape
        q = self._split_heads(mint.matmul(x, self.q))
        k = self._split_heads(mint.matmul(x, self.k))
        v = self._split_heads(mint.matmul(x, self.v))
        scores = mint.matmul(q, mint.transpose(k, -1, -2)) * (self.head_dim ** -0.5)
        probs = mint.softmax(scores + self._causal_mask(length, scores.dtype), dim=-1)
        mixed = mint.permute(mint.matmul(probs, v), (0, 2, 1, 3)).reshape(batch, length, hidden)
        return mint.matmul(mixed, self.o)


class Expert(nn.Cell):
    """SwiGLU MLP: (silu(x @ gate) * (x @ up)) @ down.

    MoE runs all experts as one batched matmul over their stacked weights; ``construct`` is the
    one-expert reference the tests compare that against.
    """

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator):
        super().__init__()
        hidden, inner = cfg.hidden_size, cfg.expert_hidden
        self.gate = _normal(rng, (hidden, inner), hidden ** -0.5)
        self.up = _normal(rng, (hidden, inner), hidden ** -0.5)
        self.down = _normal(rng, (inner, hidden), inner ** -0.5 / math.sqrt(2 * cfg.num_layers))

    def construct(self, x: Tensor) -> Tensor:
        inner = mint.nn.functional.silu(mint.matmul(x, self.gate)) * mint.matmul(x, self.up)
        return mint.matmul(inner, self.down)


class MoE(nn.Cell):
    """Top-k routed experts: computed densely without ``ep``, else this EP rank's experts only,
    sparsely, through the dispatcher (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, rng: np.random.Generator,
                 ep: Optional[ExpertParallel] = None):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.experts_per_token
        self.router = _normal(rng, (cfg.hidden_size, cfg.num_experts), cfg.hidden_size ** -0.5)
        # every expert drawn, in order, whatever this rank keeps: the same values as E=1
        drawn = [Expert(cfg, rng) for _ in range(cfg.num_experts)]
        if ep is None:
            self.experts = nn.CellList(drawn)
        else:
            self.experts = LocalExperts({g: drawn[g] for g in
                                         local_experts(cfg.num_experts, ep.size, ep.rank)})
        self.dispatch = dispatcher_for(ep, cfg.moe_dispatcher)
        self._on = Tensor(1.0, ms.float32)
        self._off = Tensor(0.0, ms.float32)
        # [num_experts] added to the logits for choosing the top k only, not to the weights
        # (DeepSeek-V3's load-balancing bias); None: no bias. Tests set it to steer routing.
        self.selection_bias: Optional[Tensor] = None

    def routing_weights(self, x: Tensor) -> Tensor:
        """[..., num_experts] weights: softmax over each token's top-k logits, 0 elsewhere.

        (DeepSeek-V2's form; V3 divides sigmoid scores by their top-k sum. Either way each
        token's k weights sum to 1.) ops.topk picks exactly k indices even on ties (on CPU it
        keeps the higher indices), so exactly k weights per token are non-zero.
        """
        logits = mint.matmul(x, self.router)
        # Only the indices of topk are used, so no gradient flows through it (nor needs to);
        # the router still learns through the softmax of the selected logits.
        scores = logits if self.selection_bias is None \
            else logits + self.selection_bias.astype(logits.dtype)
        _, chosen = ops.topk(scores, self.top_k)
        selected = ops.one_hot(chosen, self.num_experts, self._on, self._off).sum(axis=-2)
        penalty = (1.0 - selected) * MASKED
        return mint.softmax(logits + penalty.astype(logits.dtype), dim=-1)

    def construct(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])                                       # [N, H]
        if self.dispatch is not None:
            return self.dispatch(self.experts, flat, self.routing_weights(flat)).reshape(shape)
        # One batched matmul over stacked expert weights instead of one matmul per expert:
        # same values and gradients, measured 2-4x faster on CPU, where every matmul call
        # carries 0.1-several ms of host overhead. ops.stack: mint.stack has no CPU kernel.
        gate = ops.stack([expert.gate for expert in self.experts])           # [E, H, I]
        up = ops.stack([expert.up for expert in self.experts])               # [E, H, I]
        down = ops.stack([expert.down for expert in self.experts])           # [E, I, H]
        inner = mint.nn.functional.silu(mint.matmul(flat, gate)) * mint.matmul(flat, up)
        per_expert = mint.matmul(inner, down)                                 # [E, N, H]
        weights = mint.transpose(self.routing_weights(flat), 0, 1)            # [E, N]
        mixed = mint.sum(weights.reshape(self.num_experts, -1, 1) * per_expert, dim=0)
        return mixed.reshape(shape)


class DecoderLayer(nn.Cell):
    def __init__(self, cfg: ModelConfig, rng: np.random.Generator,
                 ep: Optional[ExpertParallel] = None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size)
        self.attn = Attention(cfg, rng)
        self.moe_norm = RMSNorm(cfg.hidden_size)
        self.moe = MoE(cfg, rng, ep)

    def construct(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.moe_norm(x))


class TinyDeepSeekV3(nn.Cell):
    """Token ids [batch, length] -> logits [batch, length, vocab_size]; float32 Parameters.

    All Parameters are drawn, in a fixed order, from ``numpy.random.default_rng([seed, 0])``:
    two models built from the same config and seed are identical. Names come from attribute
    paths (``embed``, ``layers.0.attn.q``, ``layers.1.moe.experts.3.down``, ``head``, ...).
    ``embed`` and ``head`` are both [vocab_size, hidden_size], so with the default odd vocab
    their dim 0 does not divide evenly across ranks.

    ``cfg.expert_parallel = E > 1`` needs ``ep``, this rank's :class:`ExpertParallel` (its
    EP group's communicator; ``build_sharded_model`` makes it): the model then holds this EP
    rank's experts only (names and values those of the E=1 model) and dispatches tokens.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 1234, ep: Optional[ExpertParallel] = None):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise InvalidArgumentError(
                f"TinyDeepSeekV3 needs a gradpool.config.ModelConfig, got {type(cfg).__name__}")
        _check_ep(cfg, ep)
        self.cfg = cfg
        rng = np.random.default_rng([seed, 0])
        self.embed = _normal(rng, (cfg.vocab_size, cfg.hidden_size), 1.0)
        self.layers = nn.CellList([DecoderLayer(cfg, rng, ep if cfg.expert_parallel > 1 else None)
                                   for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size)
        self.head = _normal(rng, (cfg.vocab_size, cfg.hidden_size), cfg.hidden_size ** -0.5)

    def construct(self, inputs: Tensor) -> Tensor:
        # ops.gather, not mint's embedding / index_select (no CPU kernels); its grad works.
        x = ops.gather(self.embed, inputs, 0)
        for layer in self.layers:
            x = layer(x)
        return mint.matmul(self.final_norm(x), mint.transpose(self.head, 0, 1))

    def loss(self, tokens: Tensor) -> Tensor:
        """Mean next-token cross-entropy of ``tokens`` [batch, seq_len + 1] (see make_batch)."""
        return next_token_loss(self, tokens)


def _check_ep(cfg: ModelConfig, ep: Optional[ExpertParallel]) -> None:
    if cfg.expert_parallel == 1:
        if ep is not None and ep.size != 1:
            raise InvalidArgumentError(
                f"TinyDeepSeekV3: model.expert_parallel = 1 but an EP group of {ep.size} ranks "
                "was given; set model.expert_parallel to the group's size or pass ep=None")
        return
    if ep is None or ep.size != cfg.expert_parallel:
        raise InvalidArgumentError(
            f"TinyDeepSeekV3: model.expert_parallel = {cfg.expert_parallel} needs this rank's "
            f"EP group of that many ranks (ep=ExpertParallel(...)), got {ep!r}; build it with "
            "gradpool.app.train.build_sharded_model, or use expert_parallel = 1 for one process")


@dataclass(frozen=True)
class ParamSpec:
    """One trainable parameter of :class:`TinyDeepSeekV3`, known without building the model.

    ``unit`` is the ``fully_shard`` unit :func:`gradpool.app.train.build_sharded_model` puts it
    in: ``"layers.<i>"`` for a decoder layer's parameters, ``"root"`` for the rest."""

    name: str
    shape: tuple
    unit: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parameter_specs(cfg: ModelConfig) -> list:
    """Every trainable parameter of ``TinyDeepSeekV3(cfg)``: name, shape and unit, in the order
    ``model.trainable_params()`` lists them (the root's own parameters, then each layer's, then
    the final norm), computed from ``cfg`` alone: a memory plan at a scale no host could build
    uses it (``gradpool plan``). ``tests/test_plan.py`` proves it equal to the built model's."""
    if not isinstance(cfg, ModelConfig):
        raise InvalidArgumentError(
            f"parameter_specs needs a gradpool.config.ModelConfig, got {type(cfg).__name__}")
    hidden, inner = cfg.hidden_size, cfg.expert_hidden
    specs = [ParamSpec("embed", (cfg.vocab_size, hidden), "root"),
             ParamSpec("head", (cfg.vocab_size, hidden), "root")]
    for index in range(cfg.num_layers):
        unit = f"layers.{index}"
        layer = [("attn_norm.weight", (hidden,))]
        layer += [(f"attn.{name}", (hidden, hidden)) for name in "qkvo"]
        layer += [("moe_norm.weight", (hidden,)), ("moe.router", (hidden, cfg.num_experts))]
        for expert in range(cfg.num_experts):
            layer += [(f"moe.experts.{expert}.gate", (hidden, inner)),
                      (f"moe.experts.{expert}.up", (hidden, inner)),
                      (f"moe.experts.{expert}.down", (inner, hidden))]
        specs += [ParamSpec(f"{unit}.{name}", shape, unit) for name, shape in layer]
    specs.append(ParamSpec("final_norm.weight", (hidden,), "root"))
    return specs


def next_token_loss(model: TinyDeepSeekV3, tokens: Tensor) -> Tensor:
    """Predict ``tokens[:, 1:]`` from ``tokens[:, :-1]``; mean cross-entropy over all positions."""
    logits = model(tokens[:, :-1])
    targets = tokens[:, 1:]
    vocab = logits.shape[-1]
    # ops.cross_entropy: mint's version needs LogSoftmaxExt, which has no CPU kernel.
    return ops.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))


def make_batch_np(cfg: ModelConfig, step: int, rank: int = 0, world: int = 1,
                  seed: int = 1234) -> np.ndarray:
    """Token ids [cfg.batch_size, cfg.seq_len + 1] (int32) for ``rank`` of ``world`` at ``step``.

    The rows of one step form a global stream indexed by *global row*; rank ``r`` of a world of
    ``W`` gets rows ``r * B .. (r + 1) * B - 1`` (``B = cfg.batch_size``, per rank). Every row is
    drawn from its own ``default_rng([seed, 1, step, global_row])``, so a row never depends on
    the world size: a single-process reference run uses ``batch_size = W * B`` with
    ``rank=0, world=1`` and gets exactly the concatenation of the W ranks' batches
    (:func:`global_batch_np` does that).

    Each row starts at a random token and then follows ``next = (5 * prev + 3) % vocab`` with
    probability 0.75 (else a uniform random token), so there is something to learn and the loss
    of a real run falls over steps, not only on a repeated batch.
    """
    for name, value, low in (("step", step, 0), ("world", world, 1), ("seed", seed, 0)):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise InvalidArgumentError(f"make_batch: {name} must be an integer >= {low}, "
                                       f"got {value!r}")
    if not isinstance(rank, (int, np.integer)) or not 0 <= rank < world:
        raise InvalidArgumentError(f"make_batch: rank must be an integer in [0, {world}), "
                                   f"got {rank!r}")
    first = rank * cfg.batch_size
    rows = [_token_row(cfg, np.random.default_rng([seed, 1, step, row]))
            for row in range(first, first + cfg.batch_size)]
    return np.stack(rows)


def _token_row(cfg: ModelConfig, rng: np.random.Generator) -> np.ndarray:
    length = cfg.seq_len + 1
    noise = rng.integers(0, cfg.vocab_size, size=length)
    follow = rng.random(length) < FOLLOW_PROB
    row = np.empty(length, np.int32)
    row[0] = noise[0]
    for i in range(1, length):
        row[i] = (MULT * row[i - 1] + INC) % cfg.vocab_size if follow[i] else noise[i]
    return row


def global_batch_np(cfg: ModelConfig, step: int, world: int, seed: int = 1234) -> np.ndarray:
    """The whole step's batch [world * cfg.batch_size, seq_len + 1]: all ranks' rows, in order."""
    return np.concatenate([make_batch_np(cfg, step, r, world, seed) for r in range(world)])


def make_batch(cfg: ModelConfig, step: int, rank: int = 0, world: int = 1,
               seed: int = 1234) -> Tensor:
    """:func:`make_batch_np` as an int32 MindSpore Tensor."""
    return Tensor(make_batch_np(cfg, step, rank, world, seed))
