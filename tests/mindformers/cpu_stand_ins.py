"""CPU stand-ins for the MindSpore 2.10 ops mindformers' PyNative GPT calls that have no CPU
kernel (or, for one, a wrong CPU gradient). Test code only: they let mindformers' own model code
run on CPU ranks; they patch neither mindformers nor this project.

Each stand-in replaces one MindSpore function or Tensor method with a composite of ops that do
have a CPU kernel and compute the same value (and the same gradient: every composite is built
from differentiable ops). :func:`install` applies them before mindformers builds a model (its
cells bind some of these functions at construction); :data:`STAND_INS` lists what each one
replaces and why, for the docs (docs/mindformers.md, "CPU caveats").

``FlashAttentionScore`` is Ascend-only, and mindformers' PyNative attention calls it whatever
``use_flash_attention`` says: :class:`CpuFlashAttentionScore` computes the same attention (masked
softmax of ``q k^T * scale``, then ``@ v``) from CPU ops for the layouts the tiny models use.
What is *not* stood in for: mindformers' non-flash ``_repeat_kv`` (it assumes a BNSD layout where
it gets SBND); the tiny models set ``num_key_value_heads == num_attention_heads`` so it never
repeats.

The MoE layer's ops (router top-k, histc, argsort, the grouped matmul, token permutation) are in
:mod:`cpu_moe_stand_ins`; :func:`install` applies them too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import mindspore as ms
from mindspore import mint, ops

import cpu_moe_stand_ins


@dataclass(frozen=True)
class StandIn:
    target: str          # what is replaced, as mindformers calls it
    kernel: str          # the MindSpore kernel that is missing (or wrong) on CPU
    composite: str       # what runs instead


STAND_INS: list[StandIn] = []
_INSTALLED: list[tuple[object, str, object]] = []


def _dtype_or(dtype, default):
    return default if dtype is None else dtype


# -- creation ops --------------------------------------------------------------------------------
def _ones(size, *, dtype=None, **_):
    return ops.ones(tuple(size) if not isinstance(size, int) else (size,),
                    _dtype_or(dtype, ms.float32))


def _full(size, fill_value, *, dtype=None, **_):
    size = tuple(size) if not isinstance(size, int) else (size,)
    if dtype is None:
        dtype = ms.float32 if isinstance(fill_value, float) else ms.int64
    return ops.fill(dtype, size, fill_value)


def _arange(start=0, end=None, step=1, *, dtype=None, **_):
    if end is None:
        start, end = 0, start
    out = ops.arange(start, end, step)
    return out if dtype is None else out.astype(dtype)


def _zeros_like(input, *, dtype=None, **_):    # noqa: A002 - MindSpore's argument name
    return ops.zeros(input.shape, _dtype_or(dtype, input.dtype))


def _ones_like(input, *, dtype=None, **_):     # noqa: A002
    return ops.ones(input.shape, _dtype_or(dtype, input.dtype))


# -- shape and index ops -------------------------------------------------------------------------
def _tril(input, diagonal=0):                  # noqa: A002
    return ops.tril(input, diagonal)


def _triu(input, diagonal=0):                  # noqa: A002
    return ops.triu(input, diagonal)


def _index_select(input, dim, index):          # noqa: A002
    return ops.gather(input, index, dim)


def _outer(input, vec2):                       # noqa: A002
    return input.reshape(-1, 1) * vec2.reshape(1, -1)


def _stack(tensors, dim=0):
    return ops.stack(tuple(tensors), dim)


def _split(tensor, split_size_or_sections, dim=0):
    """``mint.split`` then ``mint.cat`` (RoPE's rotate-half) gives a wrong gradient on CPU
    (max error 4.78 measured); ``narrow`` pieces give the right one."""
    size = tensor.shape[dim]
    if isinstance(split_size_or_sections, int):
        sizes = [split_size_or_sections] * (size // split_size_or_sections)
        if size % split_size_or_sections:
            sizes.append(size % split_size_or_sections)
    else:
        sizes = list(split_size_or_sections)
    pieces, start = [], 0
    for length in sizes:
        pieces.append(ops.narrow(tensor, dim, start, length))
        start += length
    return tuple(pieces)


# -- math ------------------------------------------------------------------------------------------
def _log_softmax(input, dim=None, dtype=None):  # noqa: A002
    if dtype is not None:
        input = input.astype(dtype)
    return ops.log_softmax(input, -1 if dim is None else dim)


def _rms_norm(input, weight, epsilon=1e-6):     # noqa: A002
    """``ops.rms_norm`` (RmsNorm) returns (y, rstd); RmsNorm has no CPU kernel."""
    variance = ops.mean(ops.square(input), -1, keep_dims=True)
    rstd = ops.rsqrt(variance + epsilon)
    return input * rstd * weight, rstd


def _swiglu(input, dim=-1):                      # noqa: A002
    first, second = _split(input, input.shape[dim] // 2, dim)
    return ops.silu(first) * second


def _dropout(input, p=0.5, training=True, inplace=False):   # noqa: A002
    if p and training:
        raise NotImplementedError("the CPU stand-in for dropout supports p=0 only "
                                  "(DropoutExt has no CPU kernel); set the model's dropouts to 0")
    return input


def _addcmul(input, tensor1, tensor2, *, value=1):   # noqa: A002
    return input + tensor1 * tensor2 * value


def _scatter_add(input, dim, index, src):         # noqa: A002
    return ops.tensor_scatter_elements(input, index, src, dim, "add")


# -- in-place initialisers (Tensor methods mindformers' reset_parameter calls) -------------------
def _assign_whole(tensor, values):
    if isinstance(tensor, ms.Parameter):
        tensor.set_data(values.astype(tensor.dtype))
    else:
        tensor.copy_(values.astype(tensor.dtype))   # a whole tensor: copy_ writes through on CPU
    return tensor


def _normal_(self, mean=0.0, std=1.0, *, generator=None):
    return _assign_whole(self, ops.normal(self.shape, ms.Tensor(mean, ms.float32),
                                          ms.Tensor(std, ms.float32)))


def _zero_(self):
    return _assign_whole(self, ops.zeros(self.shape, self.dtype))


def _fill_(self, value):
    return _assign_whole(self, ops.fill(self.dtype, self.shape, value))


def _clone(self, **_):
    return self * 1 if self.dtype != ms.bool_ else ops.logical_and(self, self)


class CpuFlashAttentionScore:
    """Stands in for ``mindspore.ops.operations.nn_ops.FlashAttentionScore`` (Ascend-only): the
    same constructor and call, computed as plain masked-softmax attention. ``attn_mask`` follows
    FlashAttentionScore's convention (1 = masked out); layouts BNSD, BSH and SBH."""

    _LAYOUTS = ("BNSD", "BSH", "SBH")

    def __init__(self, head_num=1, scale_value=1.0, pre_tokens=2147483647, next_tokens=2147483647,
                 keep_prob=1.0, inner_precise=0, input_layout="BSH", sparse_mode=0):
        if input_layout not in self._LAYOUTS:
            raise NotImplementedError(
                f"the CPU FlashAttentionScore stand-in supports layouts {self._LAYOUTS}, "
                f"not {input_layout!r}")
        if keep_prob != 1.0:
            raise NotImplementedError("the CPU FlashAttentionScore stand-in has no dropout")
        self.head_num, self.scale_value, self.input_layout = head_num, scale_value, input_layout

    def _to_bnsd(self, x):
        if self.input_layout == "BNSD":
            return x
        if self.input_layout == "SBH":
            x = x.transpose(1, 0, 2)
        batch, seq, hidden = x.shape
        return x.reshape(batch, seq, self.head_num, hidden // self.head_num).transpose(0, 2, 1, 3)

    def _from_bnsd(self, x, like):
        if self.input_layout == "BNSD":
            return x
        batch, heads, seq, dim = x.shape
        x = x.transpose(0, 2, 1, 3).reshape(batch, seq, heads * dim)
        return x.transpose(1, 0, 2) if self.input_layout == "SBH" else x

    def __call__(self, query, key, value, real_shift=None, drop_mask=None, padding_mask=None,
                 attn_mask=None, prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None):
        if real_shift is not None or prefix is not None or actual_seq_qlen is not None:
            raise NotImplementedError("the CPU FlashAttentionScore stand-in supports a plain "
                                      "(optionally masked) attention only")
        q, k, v = self._to_bnsd(query), self._to_bnsd(key), self._to_bnsd(value)
        dtype = q.dtype
        q, k, v = q.astype(ms.float32), k.astype(ms.float32), v.astype(ms.float32)
        scores = ops.matmul(q, k.swapaxes(-1, -2)) * self.scale_value
        if attn_mask is not None:
            masked = attn_mask.astype(ms.bool_)
            scores = ops.masked_fill(scores, masked, ms.Tensor(-1e30, ms.float32))
        row_max = scores.max(axis=-1, keepdims=True)
        probs = ops.softmax(scores, -1)
        out = ops.matmul(probs, v).astype(dtype)
        row_max = ops.stop_gradient(ops.tile(row_max, (1, 1, 1, 8)))
        return row_max, row_max, ops.zeros((1,), dtype), self._from_bnsd(out, query)


_TABLE: list[tuple[object, str, Callable, str, str]] = [
    (mint, "ones", _ones, "mint.ones", "FillScalar (Ones)"),
    (mint, "full", _full, "mint.full", "FillScalar"),
    (mint, "arange", _arange, "mint.arange", "Arange"),
    (mint, "zeros_like", _zeros_like, "mint.zeros_like", "ZerosLikeExt"),
    (mint, "ones_like", _ones_like, "mint.ones_like", "OnesLikeExt"),
    (mint, "tril", _tril, "mint.tril", "TrilExt"),
    (mint, "triu", _triu, "mint.triu", "Triu"),
    (mint, "index_select", _index_select, "mint.index_select", "IndexSelect"),
    (mint, "outer", _outer, "mint.outer", "Outer"),
    (mint, "stack", _stack, "mint.stack", "StackExt"),
    (mint, "split", _split, "mint.split", "SplitWithSize (wrong gradient with mint.cat)"),
    (mint, "scatter_add", _scatter_add, "mint.scatter_add", "ScatterAddExt"),
    (mint, "addcmul", _addcmul, "mint.addcmul", "AddcmulExt (mindformers' AdamW)"),
    (mint.nn.functional, "log_softmax", _log_softmax, "mint.nn.functional.log_softmax",
     "LogSoftmaxExt"),
    (mint.nn.functional, "dropout", _dropout, "mint.nn.functional.dropout", "DropoutExt"),
    (ops, "rms_norm", _rms_norm, "ops.rms_norm", "RmsNorm"),
    (ops, "swiglu", _swiglu, "ops.swiglu", "Swiglu"),
    (ms.Tensor, "normal_", _normal_, "Tensor.normal_", "InplaceNormal"),
    (ms.Tensor, "zero_", _zero_, "Tensor.zero_", "InplaceZero"),
    (ms.Tensor, "fill_", _fill_, "Tensor.fill_", "InplaceFillScalar"),
    (ms.Tensor, "clone", _clone, "Tensor.clone", "Clone"),
]


def install() -> None:
    """Apply every stand-in (idempotent). Call before mindformers is imported (some of its
    modules bind these names at import) and so before it builds a model."""
    if _INSTALLED:
        return
    from mindspore.ops.operations import nn_ops
    _INSTALLED.append((nn_ops, "FlashAttentionScore", nn_ops.FlashAttentionScore))
    nn_ops.FlashAttentionScore = CpuFlashAttentionScore
    STAND_INS.append(StandIn("FlashAttentionScore", "FlashAttentionScore (Ascend-only)",
                             CpuFlashAttentionScore.__doc__))
    for owner, attr, fn, target, kernel in _TABLE + cpu_moe_stand_ins.table():
        _INSTALLED.append((owner, attr, getattr(owner, attr, None)))
        setattr(owner, attr, fn)
        STAND_INS.append(StandIn(target, kernel, fn.__doc__ or fn.__name__))
