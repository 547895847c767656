"""moe_topk vs the Hugging Face Mixtral router composition (softmax, topk, renormalise)."""

from __future__ import annotations

import torch

import torch_topg
from torch_topg.bench.rows import Row, measure


def hf_router(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    w, ids = torch.topk(probs, k, dim=-1)
    return w / w.sum(dim=-1, keepdim=True), ids


def run(quick: bool) -> list[Row]:
    rows = []
    for tokens in [1, 512] if not quick else [1]:
        for experts, k in [(8, 2), (64, 8)]:
            logits = torch.randn(tokens, experts)
            with torch.inference_mode():
                rows.append(measure(
                    "moe", "moe_topk", f"T={tokens} E={experts} k={k}", "fp32",
                    {"topg": lambda: torch_topg.ops.moe_topk(logits, k, renormalize=True),
                     "hf softmax+topk+renorm": lambda: hf_router(logits, k)},
                    quick=quick,
                ))  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row.key, {k: v.fmt() for k, v in row.ratios.items()}, row.verdict)
