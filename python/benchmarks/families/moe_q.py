"""fused_moe_q (packed quantised experts) vs topg's fp32 / bf16 ``fused_moe`` on the same
Mixtral-like layer as families/moe.py (8 experts, top-2, H=1024, I=1408), and the
physical limit: the packed bytes of the experts hit over the read bandwidth.

Decode (1 and 8 tokens) is memory-bound and runs cold (every variant rotates through
copies of the layer that together exceed ``DRAM_FACTOR x`` the LLC): "limit" is the
fraction of the read bandwidth over the bytes each variant must read (its own format's).
512 tokens (prefill) is compute-bound: each expert's rows de-quantised, then GEMM.

    PYTHONPATH=python/benchmarks python python/benchmarks/families/moe_q.py [--quick]
"""

from __future__ import annotations

import torch

import torch_topg
from families.moe import INTER, E, H, K, routing
from torch_topg.bench.rows import Rotation, Row, measure
from torch_topg.quant import quantize_weight

FORMATS = ("q8_0", "q4_0", "q4_1", "int4_g64")


def packed_layer(fmt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's experts, packed: ``[E, 2I, row_bytes(H)]`` and ``[E, H, row_bytes(I)]``."""
    g = torch.Generator().manual_seed(seed)
    gu = [quantize_weight(torch.randn(2 * INTER, H, generator=g) * H**-0.5, fmt) for _ in range(E)]
    d = [quantize_weight(torch.randn(H, INTER, generator=g) * INTER**-0.5, fmt) for _ in range(E)]
    return torch.stack(gu), torch.stack(d)


def _case(fmt: str, tokens: int, quick: bool) -> Row:
    heavy = tokens > 64
    x = torch.randn(tokens, H)
    weights, ids = routing(tokens)
    hit = int(ids.unique().numel())
    row_gu = quantize_weight(torch.zeros(1, H), fmt).shape[1]
    row_d = quantize_weight(torch.zeros(1, INTER), fmt).shape[1]
    hit_bytes = hit * (2 * INTER * row_gu + H * row_d)
    rot = Rotation(lambda i: packed_layer(fmt, i), hit_bytes, cold=not heavy)
    dense = {}  # fp32 / bf16 experts: the dense fused_moe on the same shape

    def dense_layer(dtype: torch.dtype):
        def make(i: int):
            g = torch.Generator().manual_seed(i)
            gu = torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5
            return gu.to(dtype), (torch.randn(E, H, INTER, generator=g) * INTER**-0.5).to(dtype)

        elt = torch.empty((), dtype=dtype).element_size()
        return Rotation(make, hit * 3 * H * INTER * elt, cold=not heavy)

    dense["fp32"], dense["bf16"] = dense_layer(torch.float32), dense_layer(torch.bfloat16)
    xb = x.bfloat16()

    def q(a8: bool):
        wgu, wd = rot.next()
        return torch_topg.ops.fused_moe_q(x, wgu, wd, weights, ids, fmt, int8_activations=a8)

    def d(name: str, xx: torch.Tensor):
        wgu, wd = dense[name].next()
        return torch_topg.ops.fused_moe(xx, wgu, wd, weights, ids)

    variants = {
        "topg": lambda: q(False),
        "topg int8 act": lambda: q(True),
        "fused_moe fp32": lambda: d("fp32", x),
        "fused_moe bf16": lambda: d("bf16", xb),
    }
    case = f"T={tokens} E={E} k={K} H={H} I={INTER} {fmt}"
    with torch.inference_mode():
        if heavy:
            return measure("moe_q", "fused_moe_q", case, "fp32", variants, quick=quick,
                           heavy=True, flops=2.0 * tokens * K * 3 * H * INTER)  # fmt: skip
        return measure("moe_q", "fused_moe_q", case, "fp32", variants, quick=quick,
                       rotation=rot, dram_bytes=hit_bytes + tokens * H * 4)  # fmt: skip


def run(quick: bool) -> list[Row]:
    counts = [1, 8] if quick else [1, 8, 512]
    return [_case(fmt, t, quick) for t in counts for fmt in FORMATS]


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        figs = {k: f"{v.median:.3f}" for k, v in row.figures.items()}
        ratios = {k: v.fmt() for k, v in row.ratios.items()}
        print(row.key, "ms", figs, ratios, row.regime, row.verdict or "")
