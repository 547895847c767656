"""rms_norm / fused_add_rms_norm vs Hugging Face LlamaRMSNorm and F.rms_norm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Row, bench, bw_limit_ms, ms
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import torch_topg
from torch_topg import reference

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
            with torch.inference_mode():
                t_topg = ms(bench(lambda: torch_topg.ops.rms_norm(x, w, 1e-6)))
                t_hf = ms(bench(lambda: hf(x)))
                t_f = ms(bench(lambda: F.rms_norm(x, (hidden,), w, 1e-6)))
                t_ref = ms(bench(lambda: reference.rms_norm(x, w, 1e-6)))
            nbytes = 2 * x.numel() * x.element_size()
            decode = tokens == 1
            rows.append(
                Row("norm", "rms_norm", case, dname, t_topg,
                    {"hf LlamaRMSNorm": t_hf, "F.rms_norm": t_f, "reference": t_ref},
                    bw_limit_ms(nbytes), "read bw",
                    ("hf LlamaRMSNorm", 1.5) if decode else None)
            )  # fmt: skip
            r = torch.randn_like(x)

            def hf_add_norm(x=x, r=r):
                s = x + r
                return hf(s), s

            with torch.inference_mode():
                t_topg = ms(bench(lambda: torch_topg.ops.fused_add_rms_norm(x, r, w, 1e-6)))
                t_hf = ms(bench(hf_add_norm))
            rows.append(
                Row("norm", "fused_add_rms_norm", case, dname, t_topg,
                    {"hf add + LlamaRMSNorm": t_hf}, bw_limit_ms(2 * nbytes), "read bw",
                    ("hf add + LlamaRMSNorm", 1.5) if decode else None)
            )  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row)
