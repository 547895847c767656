"""Reference semantics of ``fused_moe_q``: each hit expert's packed weights de-quantised,
then ``fused_moe``'s math in fp32 (with int8 activations: the expert MLP's two inputs,
``x`` and the intermediate ``h``, rounded as ``linear_q`` rounds its input)."""

from __future__ import annotations

import torch

from torch_topg.formats import activation_group, dequantize, quantize_activations
from torch_topg.reference.fused_moe import ACTIVATIONS


def fused_moe_q(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    format: str,
    *,
    down_format: str | None = None,
    activation: str = "silu",
    int8_activations: bool = False,
) -> torch.Tensor:
    num_experts, hidden = w_gate_up.shape[0], hidden_states.shape[1]
    inter = w_gate_up.shape[1] // 2
    ids = topk_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise RuntimeError(
            f"topg::fused_moe_q: argument 'topk_ids' holds an expert id outside "
            f"[0, {num_experts}) (the experts of 'w_gate_up')"
        )
    act = ACTIVATIONS[activation]
    down_format = down_format or format

    def rnd(t: torch.Tensor, fmt: str) -> torch.Tensor:
        return quantize_activations(t, activation_group(fmt)) if int8_activations else t

    x, weights = rnd(hidden_states.float(), format), topk_weights.float()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():  # experts that were hit, each once
        token, slot = torch.where(ids == e)
        gate_up = x[token] @ dequantize(w_gate_up[e], format, hidden).T
        h = rnd(act(gate_up[:, :inter]) * gate_up[:, inter:], down_format)
        y = h @ dequantize(w_down[e], down_format, inter).T
        out.index_add_(0, token, y * weights[token, slot, None])
    return out.to(hidden_states.dtype)
