"""Reference semantics of ``linear_q``: de-quantise the packed weight, multiply in fp32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_topg.formats import activation_group, dequantize, quantize_activations


def linear_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    bias: torch.Tensor | None = None,
    *,
    int8_activations: bool = False,
) -> torch.Tensor:
    w = dequantize(weight, format, input.shape[-1])  # float32 [N, K]
    b = None if bias is None else bias.float()
    if int8_activations:
        x = quantize_activations(input, activation_group(format))
    else:
        x = input.float()
    return F.linear(x, w, b).to(input.dtype)
