"""silu_and_mul / gelu_and_mul vs the Hugging Face MLP composition act(gate) * up.

Two stock baselines: what transformers' LlamaMLP / GemmaMLP run (``ACT2FN[...]`` is an
nn.Module, so a module call plus a multiply) and the leanest eager form (``F.silu`` or
``F.gelu`` times ``up``). The issue's target is against the first. Run warm (gate_up is the projection's fresh
output): T=1 is "in cache"; T=512 I=14336 (56-84 MiB) is classified by its size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

import torch_topg
from torch_topg import reference
from torch_topg.bench.rows import Row, measure


def run(quick: bool) -> list[Row]:
    rows = []
    sizes = [(1, 1536), (1, 14336)] + ([] if quick else [(512, 14336)])
    for dname, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16}.items():
        for tokens, inter in sizes:
            # What a Llama MLP computes between its gate/up and down projections.
            gate_up = torch.randn(tokens, 2 * inter, dtype=dtype)
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            hf_silu, hf_gelu = ACT2FN["silu"], ACT2FN["gelu_pytorch_tanh"]
            # From DRAM: gate and up (the product is written, not read); touched: also it.
            nbytes = gate_up.numel() * gate_up.element_size()
            ws = int(1.5 * nbytes)
            case = f"T={tokens} I={inter}"
            with torch.inference_mode():
                rows.append(measure(
                    "activation", "silu_and_mul", case, dname,
                    {"topg": lambda: torch_topg.ops.silu_and_mul(gate_up),
                     "hf LlamaMLP act_fn(gate) * up": lambda: hf_silu(gate) * up,
                     "F.silu(gate) * up": lambda: F.silu(gate) * up,
                     "reference": lambda: reference.silu_and_mul(gate_up)},
                    quick=quick, dram_bytes=nbytes, working_set=ws,
                    target=("hf LlamaMLP act_fn(gate) * up", 1.5) if tokens == 1 else None,
                ))  # fmt: skip
                rows.append(measure(
                    "activation", "gelu_and_mul", case + " tanh", dname,
                    {"topg": lambda: torch_topg.ops.gelu_and_mul(gate_up, "tanh"),
                     "hf GemmaMLP act_fn(gate) * up": lambda: hf_gelu(gate) * up,
                     "F.gelu(gate) * up": lambda: F.gelu(gate, approximate="tanh") * up},
                    quick=quick, dram_bytes=nbytes, working_set=ws,
                ))  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row.key, {k: v.fmt() for k, v in row.ratios.items()}, row.regime, row.verdict)
