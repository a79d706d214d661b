"""Policies accepted by ``fully_shard`` (same names and fields as upstream)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from gradpool import InvalidArgumentError, UnsupportedDtypeError, check_bool, check_dtype


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``param_dtype``: compute dtype of gathered parameters; ``reduce_dtype``: dtype gradients
    are reduced in; ``output_dtype``: dtype module outputs are cast to; ``cast_forward_inputs``:
    cast floating inputs to ``param_dtype``; ``apply_grad_on_fp32_main_grad``: accumulate each
    reduced shard gradient into a float32 ``main_grad`` attribute of the sharded parameter."""

    param_dtype: Optional[Any] = None
    reduce_dtype: Optional[Any] = None
    output_dtype: Optional[Any] = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is None:
                continue
            try:
                check_dtype(dtype)
            except UnsupportedDtypeError as exc:
                raise InvalidArgumentError(
                    f"mp_policy.{name} must be a floating dtype or None: {exc}") from None
        check_bool("mp_policy.cast_forward_inputs", self.cast_forward_inputs)
        check_bool("mp_policy.apply_grad_on_fp32_main_grad", self.apply_grad_on_fp32_main_grad)


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Offload sharded parameters and gradients to host memory (not supported here)."""

    pin_memory: bool = True

    def __post_init__(self) -> None:
        check_bool("CPUOffloadPolicy.pin_memory", self.pin_memory)
