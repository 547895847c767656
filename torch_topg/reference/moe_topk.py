"""Reference semantics of ``moe_topk`` (router scores -> top-k experts)."""

from __future__ import annotations

import torch


def moe_topk(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = router_logits.float()
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    keys = scores if correction_bias is None else scores + correction_bias.float()
    # Stable sort: ties go to the lower expert index, as in the kernels.
    ids = keys.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids.to(torch.int32)
