"""silu_and_mul / gelu_and_mul vs the Hugging Face MLP composition act(gate) * up.

Two stock baselines: what transformers' LlamaMLP / GemmaMLP run (``ACT2FN[...]`` is an
nn.Module, so a module call plus a multiply) and the leanest eager form (``F.silu`` or
``F.gelu`` times ``up``). The issue's target is against the first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Row, bench, bw_limit_ms, ms
from transformers.activations import ACT2FN

import torch_topg
from torch_topg import reference


def run(quick: bool) -> list[Row]:
    rows = []
    sizes = [(1, 1536), (1, 14336)] + ([] if quick else [(512, 14336)])
    for dname, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16}.items():
        for tokens, inter in sizes:
            # What a Llama MLP computes between its gate/up and down projections.
            gate_up = torch.randn(tokens, 2 * inter, dtype=dtype)
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
            hf_silu, hf_gelu = ACT2FN["silu"], ACT2FN["gelu_pytorch_tanh"]
            with torch.inference_mode():
                t_topg = ms(bench(lambda: torch_topg.ops.silu_and_mul(gate_up)))
                t_hf_mlp = ms(bench(lambda: hf_silu(gate) * up))
                t_hf_mlp_gelu = ms(bench(lambda: hf_gelu(gate) * up))
                t_hf = ms(bench(lambda: F.silu(gate) * up))
                t_ref = ms(bench(lambda: reference.silu_and_mul(gate_up)))
                t_gelu = ms(bench(lambda: torch_topg.ops.gelu_and_mul(gate_up, "tanh")))
                t_hf_gelu = ms(bench(lambda: F.gelu(gate, approximate="tanh") * up))
            nbytes = 1.5 * gate_up.numel() * gate_up.element_size()
            case = f"T={tokens} I={inter}"
            rows.append(
                Row("activation", "silu_and_mul", case, dname, t_topg,
                    {"hf LlamaMLP act_fn(gate) * up": t_hf_mlp, "F.silu(gate) * up": t_hf,
                     "reference": t_ref}, bw_limit_ms(nbytes), "read bw",
                    ("hf LlamaMLP act_fn(gate) * up", 1.5) if tokens == 1 else None)
            )  # fmt: skip
            rows.append(
                Row("activation", "gelu_and_mul", case + " tanh", dname, t_gelu,
                    {"hf GemmaMLP act_fn(gate) * up": t_hf_mlp_gelu, "F.gelu(gate) * up": t_hf_gelu},
                    bw_limit_ms(nbytes), "read bw")
            )  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row)
