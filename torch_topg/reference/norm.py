"""Reference semantics of the norm ops (plain PyTorch, fp32 math, one rounding)."""

from __future__ import annotations

import torch


def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    x = input.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + epsilon) * weight.float()
    return y.to(input.dtype)


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    residual.add_(input)  # rounded to residual's dtype, as the kernel stores it
    input.copy_(rms_norm(residual, weight, epsilon))
