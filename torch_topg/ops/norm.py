"""RMSNorm ops: ``rms_norm`` and ``fused_add_rms_norm``."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.ops._checks import Arg
from torch_topg.ops._library import eager_entry, register

_rms_norm = eager_entry("rms_norm")
_fused_add_rms_norm = eager_entry("fused_add_rms_norm")


def _check_norm(op: str, input: torch.Tensor, weight: torch.Tensor) -> None:
    Arg(op, "input", input).min_dim(1).floating()
    Arg(op, "weight", weight).dim(1).floating().same_device(input, "input").contiguous().size(
        0, input.shape[-1], "the hidden size of 'input'"
    )


def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """RMSNorm: ``input / sqrt(mean(input**2, -1) + epsilon) * weight``.

    Args:
        input: ``[..., hidden]``, float32 / bfloat16 / float16, any layout.
        weight: ``[hidden]``, the dtype of ``input`` or float32.
        epsilon: added to the mean square.

    Returns:
        ``[..., hidden]`` in the dtype of ``input``. Math is fp32, rounded once.
    """
    if torch.compiler.is_compiling():
        return torch.ops.topg.rms_norm.default(input, weight, epsilon)
    return _rms_norm(input, weight, epsilon)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float = 1e-6
) -> None:
    """In place: ``residual += input``, then ``input = rms_norm(residual, weight)``.

    Args:
        input: ``[..., hidden]`` contiguous; overwritten with the normalised sum.
        residual: same shape and dtype as ``input``, contiguous; overwritten with the sum.
        weight: ``[hidden]``, the dtype of ``input`` or float32.
    """
    if torch.compiler.is_compiling():
        torch.ops.topg.fused_add_rms_norm.default(input, residual, weight, epsilon)
    else:
        _fused_add_rms_norm(input, residual, weight, epsilon)


def _check_rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> None:
    _check_norm("rms_norm", input, weight)


def check_add_rms_norm(
    op: str, input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> None:
    """The argument check of an in-place residual add + RMSNorm named ``op`` (also
    ``fused_all_reduce_add_rms_norm``'s)."""
    _check_norm(op, input, weight)
    Arg(op, "input", input).contiguous()
    r = Arg(op, "residual", residual).same_dtype(input, "input").same_device(input, "input")
    r.contiguous()
    shape = f"[{', '.join(map(str, input.shape))}]"
    if residual.dim() != input.dim():
        r.fail(f"the shape of 'input' {shape}")
    for d in range(input.dim()):
        torch._check(
            residual.shape[d] == input.shape[d], r.message(f"the shape of 'input' {shape}")
        )


def _check_fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    check_add_rms_norm("fused_add_rms_norm", input, residual, weight)


register(
    "rms_norm",
    check=_check_rms_norm,
    wrapper=rms_norm,
    fake=lambda input, weight, epsilon: torch.empty_like(
        input, memory_format=torch.contiguous_format
    ),
    reference=reference.rms_norm,
)
register(
    "fused_add_rms_norm",
    check=_check_fused_add_rms_norm,
    wrapper=fused_add_rms_norm,
    fake=lambda input, residual, weight, epsilon: None,
    reference=reference.fused_add_rms_norm,
)
