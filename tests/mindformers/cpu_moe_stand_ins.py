"""CPU stand-ins for the ops mindformers' PyNative MoE layer calls that have no CPU kernel in
MindSpore 2.10 (its router, ``TopKRouter``, and its experts, ``GroupedMLP``, the only experts
its ``moe_grouped_gemm: True`` spec builds). Test code only, installed by
:func:`cpu_stand_ins.install` with the others; each computes what the op computes, from ops that
have a CPU kernel, and is differentiable where the op is (tests/mindformers/test_cpu_stand_ins.py
checks values and gradients against NumPy).

The index-producing stand-ins (``argsort``, ``histc``, the routing order of
``moe_token_permute``) count by comparison (an ``n x n`` or ``n x bins`` boolean table) instead
of sorting: exact, order-stable, and small at the tiny models' token counts. The grouped matmul
multiplies every row by every expert's weight and keeps the row's own expert's product (an
``experts``-fold of the work, exact: the other products are multiplied by 0 and summed).
"""
from __future__ import annotations

import mindspore as ms
from mindspore import ops


def _positions(n: int) -> ms.Tensor:
    return ops.arange(0, n, 1).astype(ms.int64)


def _to_last(x, dim: int):
    dim = dim % x.ndim
    return x if dim == x.ndim - 1 else ops.swapaxes(x, dim, -1)


def _ranks(x, descending: bool = False):
    """Along the last dim: each element's position in the stable sort of its row (ties keep
    their order). Element i is preceded by every j that sorts before it, and by every equal j
    with j < i."""
    n = x.shape[-1]
    mine, theirs = x.unsqueeze(-1), x.unsqueeze(-2)          # [..., i, 1], [..., 1, j]
    before = theirs > mine if descending else theirs < mine
    pos = _positions(n)
    earlier = pos.reshape(1, n) < pos.reshape(n, 1)          # [i, j]: j < i
    ahead = ops.logical_or(before, ops.logical_and(theirs == mine, earlier))
    return ahead.astype(ms.int32).sum(-1).astype(ms.int64)


def _inverse_permutation(ranks):
    """Along the last dim: ``order[r] = i`` where ``ranks[i] == r``."""
    n = ranks.shape[-1]
    pos = _positions(n)
    hits = ranks.unsqueeze(-2) == pos.reshape(n, 1)          # [..., r, i]
    return (hits.astype(ms.int64) * pos.reshape(1, n)).sum(-1)


# -- router ---------------------------------------------------------------------------------------
def _topk(input, k, dim=-1, largest=True, sorted=True):       # noqa: A002 - MindSpore's names
    """``mint.topk`` (TopkExt): ``ops.topk`` (TopK has a CPU kernel and a gradient)."""
    return ops.topk(input, k, dim, largest, sorted)


def _histc(input, bins=100, min=0, max=0):                     # noqa: A002
    """``mint.histc`` (HistcExt): ``bins`` equal-width bins over ``[min, max]``, the last bin
    closed; elements outside are ignored; ``min == max == 0`` takes the data's range. Counts in
    the input's dtype (mindformers casts them at once)."""
    x = ops.stop_gradient(input).astype(ms.float32).reshape(-1)
    low, high = float(min), float(max)
    if low == high == 0.0:
        low, high = float(x.min().asnumpy()), float(x.max().asnumpy())
    if low == high:
        low, high = low - 1.0, high + 1.0
    width = (high - low) / bins
    index = ops.minimum(ops.floor((x - low) / width), float(bins - 1))
    inside = ops.logical_and(x >= low, x <= high)
    hits = ops.logical_and(inside.unsqueeze(-1),
                           index.unsqueeze(-1) == _positions(bins).astype(ms.float32))
    return hits.astype(ms.int32).sum(0).astype(input.dtype)


def _scatter_(self, dim, index, src=None, *, value=None, reduce=None):
    """``Tensor.scatter_`` (InplaceScatterValue / InplaceScatterSrc): the scattered tensor
    computed out of place, then written over the whole of ``self`` (a whole-tensor ``copy_``
    writes through on CPU)."""
    if reduce is not None:
        raise NotImplementedError("the CPU stand-in for Tensor.scatter_ has no reduce")
    src = value if src is None else src
    if not isinstance(src, ms.Tensor):
        src = ops.fill(self.dtype, index.shape, src)
    work = ms.int32 if self.dtype == ms.bool_ else self.dtype
    new = ops.tensor_scatter_elements(self.astype(work), index, src.astype(work), dim)
    self.copy_(new.astype(self.dtype))
    return self


# -- experts: permutation ------------------------------------------------------------------------
def _argsort(input, dim=-1, descending=False, stable=False):    # noqa: A002
    """``mint.argsort`` (ArgSort): the inverse of each element's stable rank (a stable sort is
    a valid answer whatever ``stable`` says)."""
    x = _to_last(ops.stop_gradient(input), dim)
    order = _inverse_permutation(_ranks(x, descending))
    return _to_last(order, dim)


def _cumsum(input, dim, dtype=None):                           # noqa: A002
    """``mint.cumsum`` (CumsumExt): ``ops.cumsum``."""
    return ops.cumsum(input, dim, dtype=dtype)


def _floor_divide(input, other):                               # noqa: A002
    """``mint.floor_divide`` (FloorDivScalar): ``ops.floor_div``."""
    return ops.floor_div(input, other)


def _moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """``ops.moe_token_permute`` (MoeTokenPermute): the ``[num_tokens, topk]`` routing entries
    sorted by expert (stable: within an expert, in token order), each row the token it routes;
    returns ``(permuted_tokens, sorted_indices)`` where ``sorted_indices[i]`` is the row entry
    ``i`` went to (what ``moe_token_unpermute`` reads)."""
    if padded_mode:
        raise NotImplementedError("the CPU stand-in for moe_token_permute has no padded mode")
    topk = 1 if indices.ndim == 1 else indices.shape[1]
    flat = ops.stop_gradient(indices).reshape(-1).astype(ms.int64)
    if num_out_tokens not in (None, flat.shape[0]):
        raise NotImplementedError("the CPU stand-in for moe_token_permute drops no tokens "
                                  f"(num_out_tokens={num_out_tokens})")
    ranks = _ranks(flat)
    order = _inverse_permutation(ranks)
    permuted = ops.gather(tokens, ops.floor_div(order, topk), 0)
    return permuted, ranks.astype(ms.int32)


def _moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                         restore_shape=None):
    """``ops.moe_token_unpermute`` (MoeTokenUnpermute): each token's ``topk`` rows gathered
    back (``sorted_indices`` from ``moe_token_permute``), weighted by ``probs`` and summed."""
    if padded_mode or restore_shape is not None:
        raise NotImplementedError("the CPU stand-in for moe_token_unpermute has no padded mode")
    topk = 1 if probs is None else probs.shape[-1]
    rows = ops.gather(permuted_tokens, sorted_indices.reshape(-1).astype(ms.int64), 0)
    rows = rows.reshape(-1, topk, permuted_tokens.shape[-1])
    if probs is not None:
        rows = rows * probs.reshape(-1, topk).astype(rows.dtype).unsqueeze(-1)
    return rows.sum(1)


# -- experts: grouped matmul ---------------------------------------------------------------------
class CpuGroupedMatmul:
    """Stands in for ``mindspore.ops.auto_generate.GroupedMatmul`` (GroupedMatmul is Ascend-only)
    in the form mindformers' GroupedMLP calls it: ``split_item=3, group_type=0``, one ``x``
    ``[rows, k]`` split along its rows by ``group_list`` (cumulative row counts, one per expert),
    one ``weight`` ``[experts, k, n]``; the result ``[y]``, ``y[rows, n]``, each row times its
    group's weight. Rows past the last group's end get zeros."""

    def __init__(self, split_item=0, group_type=-1, transpose_a=False, transpose_b=False):
        if (split_item, group_type, transpose_a, transpose_b) != (3, 0, False, False):
            raise NotImplementedError(
                "the CPU GroupedMatmul stand-in supports split_item=3, group_type=0 without "
                f"transposes, not split_item={split_item}, group_type={group_type}, "
                f"transpose_a={transpose_a}, transpose_b={transpose_b}")

    def __call__(self, x, weight, bias=None, scale=None, offset=None, antiquant_scale=None,
                 antiquant_offset=None, group_list=None):
        if any(t is not None for t in (bias, scale, offset, antiquant_scale, antiquant_offset)):
            raise NotImplementedError("the CPU GroupedMatmul stand-in has no bias, scale or "
                                      "quantisation inputs")
        if group_list is None or len(x) != 1 or len(weight) != 1:
            raise NotImplementedError("the CPU GroupedMatmul stand-in takes one x, one weight "
                                      "and a group_list")
        (rows,), (w,) = x, weight
        experts = w.shape[0]
        ends = ops.stop_gradient(group_list).astype(ms.int64).reshape(1, experts)
        row = _positions(rows.shape[0]).reshape(-1, 1)
        group = (row >= ends).astype(ms.int32).sum(-1).astype(ms.int64)        # [rows]
        member = (group.reshape(-1, 1) == _positions(experts).reshape(1, -1)).astype(rows.dtype)
        every = ops.matmul(rows.unsqueeze(0), w)                                # [experts, rows, n]
        return [(every * member.swapaxes(0, 1).unsqueeze(-1)).sum(0)]


def table():
    """``(owner, attribute, stand-in, target, missing kernel)`` rows for :mod:`cpu_stand_ins`."""
    from mindspore import mint
    from mindspore.ops import auto_generate
    return [
        (mint, "topk", _topk, "mint.topk", "TopkExt"),
        (mint, "histc", _histc, "mint.histc", "HistcExt"),
        (mint, "argsort", _argsort, "mint.argsort", "ArgSort"),
        (mint, "cumsum", _cumsum, "mint.cumsum", "CumsumExt"),
        (mint, "floor_divide", _floor_divide, "mint.floor_divide", "FloorDivScalar"),
        (ms.Tensor, "scatter_", _scatter_, "Tensor.scatter_", "InplaceScatterValue"),
        (ops, "moe_token_permute", _moe_token_permute, "ops.moe_token_permute",
         "MoeTokenPermute"),
        (ops, "moe_token_unpermute", _moe_token_unpermute, "ops.moe_token_unpermute",
         "MoeTokenUnpermute"),
        (auto_generate, "GroupedMatmul", CpuGroupedMatmul, "GroupedMatmul", "GroupedMatmul"),
    ]
