"""linear_q (packed weight-only quantised weights) vs topg's fp32 / bf16 ``linear`` on the
same shape, and the physical limit: the packed bytes over the read bandwidth. "topg" is
the default (fp32 activations), "topg int8 act" the ``int8_activations=True`` option.

M = 1 rows are memory-bound and run cold (weights rotated through copies that together
exceed ``DRAM_FACTOR x`` the LLC, as a model's layers follow one another): "limit" is
the fraction of the read bandwidth over the packed bytes reached by the default (fp32
activations), "limit topg int8 act" the one reached with int8 activations. The issue's
target at M = 1: at least 80% for q8_0 and int8, judged on the int8-activation GEMV
(llama.cpp's arithmetic, the path built to be bound by the reads; the fp32-activation
GEMV converts every code to a float and is bound by that arithmetic where the memory is
fast). M = 64 and M = 512 (a SmolLM2 prefill's gate/up shape)
are compute-bound and compared with the fp32 linear: fp32 activations take the packed
GEMM path (de-quantise to fp32, then GEMM), int8 activations the integer GEMM where the
CPU has AVX-512 VNNI (gemm_q8_vnni.h).

    PYTHONPATH=python/benchmarks python python/benchmarks/families/linear_q.py [--quick]
"""

from __future__ import annotations

import torch

import torch_topg
from torch_topg.bench.rows import Rotation, Row, measure
from torch_topg.quant import quantize_weight

FORMATS = ("q8_0", "int8", "q4_0", "q4_1", "int4_g64", "int4_g128")
INT8 = "topg int8 act"
TARGET = {"q8_0": (f"limit {INT8}", 0.8), "int8": (f"limit {INT8}", 0.8)}


def _case(m: int, k: int, n: int, fmt: str, quick: bool) -> Row:
    heavy = m > 16
    x = torch.randn(m, k)

    def weight(i: int) -> torch.Tensor:
        return torch.randn(n, k, generator=torch.Generator().manual_seed(i)) / k**0.5

    packed = quantize_weight(torch.zeros(1, k), fmt).shape[1] * n
    # one rotation per variant, each cold on its own bytes
    rot = Rotation(lambda i: (quantize_weight(weight(i), fmt),), packed, cold=not heavy)
    rot32 = Rotation(lambda i: (weight(i),), n * k * 4, cold=not heavy)
    rot16 = Rotation(lambda i: (weight(i).bfloat16(),), n * k * 2, cold=not heavy)
    xb = x.bfloat16()
    variants = {
        "topg": lambda: torch_topg.ops.linear_q(x, rot.next()[0], fmt),
        INT8: lambda: torch_topg.ops.linear_q(x, rot.next()[0], fmt, int8_activations=True),
        "linear fp32": lambda: torch_topg.ops.linear(x, rot32.next()[0]),
        "linear bf16": lambda: torch_topg.ops.linear(xb, rot16.next()[0]),
    }
    if heavy:
        kw = {"flops": 2.0 * m * n * k}
        target = None
    else:
        kw = {"dram_bytes": packed + m * k * 4, "rotation": rot, "limit_for": (INT8,)}
        target = TARGET.get(fmt)
    with torch.inference_mode():
        return measure("linear_q", "linear_q", f"M={m} K={k} N={n} {fmt}", "fp32", variants,
                       quick=quick, heavy=heavy, target=target, **kw)  # fmt: skip


def run(quick: bool) -> list[Row]:
    shapes = [(1, 4096, 4096), (1, 576, 1536)]
    if not quick:
        shapes += [(64, 4096, 4096), (512, 576, 3072)]
    return [_case(*s, fmt, quick) for s in shapes for fmt in FORMATS]


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        figs = {k: f"{v.median:.3f}" for k, v in row.figures.items()}
        ratios = {k: v.fmt() for k, v in row.ratios.items()}
        print(row.key, "ms", figs, ratios, row.regime, row.verdict or "")
