"""Reference semantics of ``linear`` (plain PyTorch, fp32 math, one rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    b = None if bias is None else bias.float()
    return F.linear(input.float(), weight.float(), b).to(input.dtype)
