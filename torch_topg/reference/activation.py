"""Reference semantics of the gated activations: ``act(x[..., :d]) * x[..., d:]``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    gate, up = input.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(input.dtype)


def gelu_and_mul(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    gate, up = input.float().chunk(2, dim=-1)
    return (F.gelu(gate, approximate=approximate) * up).to(input.dtype)
