"""Perplexity of a GGUF file's packed model under three roundings of the activations.

For llama.cpp's Q8_0 / Q4_1 / Q4_0 files (made by ``quantized.py``'s llama.cpp build),
on llama.cpp's own token ids of the shipped text, chunks of 512 scored as
``llama-perplexity -c 512`` does (``quantized_llama.topg_ppl``), every packed linear
computed by the reference (weights de-quantised, fp32 matmul) with its input:

- ``fp32``: as it is (the engine's default);
- ``topg``: rounded to 8 bits per block of 32 as ``linear_q(..., int8_activations=True)``
  does (``d = amax / 127`` in fp32, round half to even);
- ``llama``: as llama.cpp's ``quantize_row_q8_0`` does (round half away from zero, the
  block scale stored as a half).

It asks whether the gap between topg's and llama-perplexity's figures for the same file
is the activations' rounding (docs/quantization.md has the answer: it is not).

    python python/benchmarks/quantized_rounding.py [--formats q8_0,q4_1,q4_0] [--chunks 7]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_cpp_build import ensure_llama_cpp
from quantized import eval_text
from quantized_llama import gguf_file, llama_ids, topg_ppl

from torch_topg.engine.loading import load_config
from torch_topg.formats import dequantize
from torch_topg.quant import modules
from torch_topg.quant.gguf_direct import load_packed


def round_blocks(x: torch.Tensor, llama: bool) -> torch.Tensor:
    """``x`` [..., K] rounded to int8 per block of 32 and scaled back (see the module doc)."""
    k = x.shape[-1]
    xb = F.pad(x.float(), (0, -k % 32)).reshape(*x.shape[:-1], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    v = (xb * torch.where(d == 0, torch.zeros_like(d), 1.0 / d)).clamp(-127, 127)
    if llama:
        q, d = torch.sign(v) * torch.floor(v.abs() + 0.5), d.half().float()
    else:
        q = torch.round(v)
    return (q * d).reshape(*x.shape[:-1], -1)[..., :k]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="q8_0,q4_1,q4_0")
    ap.add_argument("--chunks", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(2)
    llama = ensure_llama_cpp()
    mode = {"m": "fp32"}
    weights: dict[int, torch.Tensor] = {}

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        w = weights.get(id(self))
        if w is None:
            w = weights[id(self)] = dequantize(self.qweight, self.format, input.shape[-1])
        x = input.float() if mode["m"] == "fp32" else round_blocks(input, mode["m"] == "llama")
        b = None if self.bias is None else self.bias.float()
        return F.linear(x, w, b).to(input.dtype)

    modules.QuantizedLinear.forward = forward  # this process only
    print("| file | fp32 | int8, topg's rounding | int8, llama.cpp's rounding |")
    print("|---|---|---|---|")
    for fmt in a.formats.split(","):
        path = gguf_file(fmt, llama)
        ids = llama_ids(llama, path, eval_text())
        config, _ = load_config(path)
        model = load_packed(path, config, torch.float32)
        weights.clear()
        ppl = {}
        for m in ("fp32", "topg", "llama"):
            mode["m"] = m
            ppl[m] = topg_ppl(model, ids, a.chunks)
        print(f"| {fmt} | {ppl['fp32']:.4f} | {ppl['topg']:.4f} | {ppl['llama']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
