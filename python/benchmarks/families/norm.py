"""rms_norm / fused_add_rms_norm vs Hugging Face LlamaRMSNorm and F.rms_norm.

Run warm (the inputs of a norm are the previous op's fresh output): the decode rows
(T=1) and T=512 (8-16 MiB) are "in cache" and not compared with the DRAM limit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import torch_topg
from torch_topg import reference
from torch_topg.bench.rows import Row, measure

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run(quick: bool) -> list[Row]:
    rows = []
    sizes = [(1, 576), (1, 4096), (512, 4096)] if not quick else [(1, 576), (1, 4096)]
    for dname, dtype in DTYPES.items():
        for tokens, hidden in sizes:
            x = torch.randn(tokens, hidden, dtype=dtype)
            hf = LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
            w = hf.weight.detach()
            case = f"T={tokens} H={hidden}"
            n, wb = x.numel() * x.element_size(), w.numel() * w.element_size()
            decode = tokens == 1
            with torch.inference_mode():
                rows.append(measure(
                    "norm", "rms_norm", case, dname,
                    {"topg": lambda: torch_topg.ops.rms_norm(x, w, 1e-6),
                     "hf LlamaRMSNorm": lambda: hf(x),
                     "F.rms_norm": lambda: F.rms_norm(x, (hidden,), w, 1e-6),
                     "reference": lambda: reference.rms_norm(x, w, 1e-6)},
                    # from DRAM: x and w (the output is written, not read)
                    quick=quick, dram_bytes=n + wb, working_set=2 * n + wb,
                    target=("hf LlamaRMSNorm", 1.5) if decode else None,
                ))  # fmt: skip
                r = torch.randn_like(x)

                def hf_add_norm(x=x, r=r):
                    s = x + r
                    return hf(s), s

                # In place: x, r and w come from DRAM; x and r are written back.
                rows.append(measure(
                    "norm", "fused_add_rms_norm", case, dname,
                    {"topg": lambda: torch_topg.ops.fused_add_rms_norm(x, r, w, 1e-6),
                     "hf add + LlamaRMSNorm": hf_add_norm},
                    quick=quick, dram_bytes=2 * n + wb,
                    target=("hf add + LlamaRMSNorm", 1.5) if decode else None,
                ))  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row.key, {k: v.fmt() for k, v in row.ratios.items()}, row.regime, row.verdict)
