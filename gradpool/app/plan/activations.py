"""The activations a rank keeps for backward in one micro-step, counted from the model's shapes.

One micro-step's activations live at once (each micro-step's backward frees them before the
next forward), so the count is for ``model.batch_size`` sequences of ``model.seq_len`` tokens:
``N = batch_size * seq_len`` tokens per rank. Tensors are in the compute dtype
(``fully_shard.param_dtype``, float32 if unset) unless said otherwise. What each layer keeps,
from :mod:`gradpool.app.model`:

* two RMSNorms: input and output ``[N, H]`` each, and ``1 / rms`` ``[N]``;
* attention: q, k, v and the heads' mixed output ``[N, H]`` each, and the softmax's
  probabilities ``[B, heads, L, L]``: the model materialises the scores (no fused or flash
  attention is assumed, on Ascend either);
* the router's probabilities ``[N, num_experts]``;
* the experts. With ``expert_parallel = 1`` the model computes densely, every expert on every
  token: four ``[num_experts, N, expert_hidden]`` intermediates (gate, up, silu, product) and the
  per-expert outputs ``[num_experts, N, H]``; it stacks the experts' gathered weights into three
  ``[num_experts, H, expert_hidden]`` tensors for one batched matmul, and autograd keeps those
  copies until the layer's backward (after the gathered weights themselves are released). With ``E > 1`` each rank computes its local experts
  on the tokens routed to them only: with balanced routing ``P = N * k`` token-expert pairs per
  rank (the EP group's ``E * N`` tokens times ``k`` routes, over E ranks), each keeping its input
  row ``[H]``, four ``[expert_hidden]`` intermediates and its output row ``[H]``;
* the dispatch buffers (``E > 1``). All-gather dispatcher: the EP group's gathered tokens
  ``[E * N, H]`` and routing (top-k indices int32 and weights, ``[E * N, k]`` each) are kept; the
  combine's ``[E * N, H]`` partial sums, before their reduce-scatter, live one layer at a time.
  All-to-all dispatcher: the combined expert outputs ``[P, H]`` back on the token's rank are kept
  (the routing weights multiply them); the permuted send buffer ``[P, H]`` lives one layer at a
  time.

Beside the layers: the final norm (``[N, H]`` in and out), and the loss's logits ``[N, vocab]``:
the float32 log-probabilities the cross-entropy keeps and, in its backward, their gradient.
During any backward the gradient of the layer's largest activation exists beside it (the
attention probabilities' at long sequences); the count adds it once.

Full recompute keeps each layer's input ``[N, H]`` and recomputes the layer in its backward, so a
rank holds every layer's input, one layer's full activations, and the root's. Not counted:
activation gradients other than the largest, temporary workspaces of kernels, allocator
fragmentation.
"""
from __future__ import annotations

from dataclasses import dataclass

from gradpool.app.config import RunConfig
from gradpool.app.plan.options import ITEMSIZE

INDEX_BYTES = 4                 # int32 top-k indices
LOSS_BYTES = 4                  # the loss works in float32


@dataclass(frozen=True)
class ActivationPlan:
    """Per rank, bytes, for one micro-step of ``tokens`` tokens."""

    tokens: int
    dtype: str
    dispatcher: str               # "dense (expert_parallel 1)", "all-to-all", "all-gather"
    routed_pairs: int             # token-expert pairs a rank's experts compute per layer
    attention: str                # what the attention count assumes
    norms_bytes: int              # per layer
    attention_bytes: int          # per layer, the probabilities included
    scores_bytes: int             # per layer, the probabilities [B, heads, L, L]
    moe_bytes: int                # per layer: router and experts
    dispatch_bytes: int           # per layer: the dispatch buffers kept for backward
    per_layer_bytes: int          # the sum of the four above
    layer_input_bytes: int        # [N, H], what full recompute keeps per layer
    transient_bytes: int          # one layer at a time: dispatch buffers, the largest gradient
    root_bytes: int               # final norm and the loss's logits
    layers: int
    plain_bytes: int              # every layer's activations kept
    recompute_bytes: int          # full recompute


def plan_activations(cfg: RunConfig, compute_dtype: str, dispatcher: str) -> ActivationPlan:
    """The activation estimate of ``cfg`` (see the module docstring); ``dispatcher`` is
    ``"all-to-all"`` or ``"all-gather"`` (used where ``expert_parallel > 1``)."""
    m = cfg.model
    size = ITEMSIZE[compute_dtype]
    batch, length, hidden = m.batch_size, m.seq_len, m.hidden_size
    tokens = batch * length
    ep, k, inner = m.expert_parallel, m.experts_per_token, m.expert_hidden
    norm = 2 * tokens * hidden + tokens
    scores = batch * m.num_heads * length * length
    attention = 4 * tokens * hidden + scores
    router = tokens * m.num_experts
    if ep == 1:
        pairs = tokens * m.num_experts
        stacked_weights = 3 * m.num_experts * hidden * inner
        experts = m.num_experts * tokens * (4 * inner + hidden) + stacked_weights
        kept = transient = 0
        dispatcher = "dense (expert_parallel 1: every expert on every token)"
    else:
        pairs = tokens * k
        experts = pairs * (2 * hidden + 4 * inner)
        if dispatcher == "all-gather":
            gathered = ep * tokens
            kept = gathered * hidden * size + gathered * k * (INDEX_BYTES + size)
            transient = gathered * hidden * size
        else:
            kept = transient = pairs * hidden * size
    # the largest single tensor a layer keeps: its gradient exists beside it in backward
    rows = m.num_experts * tokens if ep == 1 else pairs      # rows the experts compute on
    stack = m.num_experts * hidden * inner if ep == 1 else 0     # one stacked weight (dense)
    largest = max(scores, tokens * hidden, router, rows * inner, rows * hidden, stack)
    per_layer = (2 * norm + attention + router + experts) * size + kept
    layer_input = tokens * hidden * size
    root = (2 * tokens * hidden + tokens) * size + 2 * tokens * m.vocab_size * LOSS_BYTES
    transient += largest * size
    layers = m.num_layers
    return ActivationPlan(
        tokens=tokens, dtype=compute_dtype, dispatcher=dispatcher, routed_pairs=pairs,
        attention="scores materialised [batch, heads, L, L] (no fused attention assumed)",
        norms_bytes=2 * norm * size, attention_bytes=attention * size, scores_bytes=scores * size,
        moe_bytes=(router + experts) * size, dispatch_bytes=kept, per_layer_bytes=per_layer,
        layer_input_bytes=layer_input, transient_bytes=transient, root_bytes=root, layers=layers,
        plain_bytes=layers * per_layer + root + transient,
        recompute_bytes=layers * layer_input + per_layer + root + transient)
