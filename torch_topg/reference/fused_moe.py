"""Reference semantics of the MoE ops (plain PyTorch, fp32 math, one rounding)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: ``activation`` name -> the function (``fused_moe_q``'s reference uses the same table).
ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def fused_moe(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    num_experts, inter = w_gate_up.shape[0], w_down.shape[-1]
    ids = topk_ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise RuntimeError(
            f"topg::fused_moe: argument 'topk_ids' holds an expert id outside [0, {num_experts}) "
            "(the experts of 'w_gate_up')"
        )
    act = ACTIVATIONS[activation]
    x, weights = hidden_states.float(), topk_weights.float()
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():  # experts that were hit, each once
        token, slot = torch.where(ids == e)
        gate_up = x[token] @ w_gate_up[e].float().T
        h = act(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, token, (h @ w_down[e].float().T) * weights[token, slot, None])
    return out.to(hidden_states.dtype)
