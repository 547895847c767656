"""fused_moe vs transformers 5 Mixtral experts (grouped_mm and eager) and the reference.

Mixtral-like small config: 8 experts, top-2, H=1024, I=1408. Decode (1..8 tokens) is
memory-bound: the limit is the bytes of the experts hit over the measured read bandwidth.
The decode rows run cold: the experts are rotated through copies of the layer that
together hold at least ``DRAM_FACTOR x`` the LLC (one token hits 2 experts, 17-35 MiB:
in the LLC if run warm), every variant on the same rotation. 512 tokens is
compute-bound: "of best" (the best rate any variant reached) and "of peak".
"""

from __future__ import annotations

import torch

import torch_topg
from torch_topg import reference
from torch_topg.bench.rows import Rotation, Row, measure

E, K, H, INTER = 8, 2, 1024, 1408
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixtral_experts(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K
    )
    experts = MixtralExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, H**-0.5, generator=g)
        experts.down_proj.normal_(0, INTER**-0.5, generator=g)
    return experts.to(dtype).eval()


def routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), K)
    return weights / weights.sum(-1, keepdim=True), ids


def _case(pool: list, dtype: torch.dtype, tokens: int, dname: str, check: bool, quick: bool) -> Row:
    heavy = tokens > 64
    x = torch.randn(tokens, H).to(dtype)
    weights, ids = routing(tokens)
    elt = torch.empty((), dtype=dtype).element_size()
    hit = int(ids.unique().numel())
    hit_bytes = hit * 3 * H * INTER * elt  # gate, up and down of each expert hit

    def layer(i: int):  # the pool keeps the copies for the next token count
        while len(pool) <= i:
            pool.append(mixtral_experts(dtype, seed=len(pool)))
        return (pool[i],)

    rot = Rotation(layer, hit_bytes, cold=not heavy)

    def topg():
        e = rot.next()[0]
        return torch_topg.ops.fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids)

    def hf(impl: str):
        e = rot.next()[0]
        e.config._experts_implementation = impl
        return e(x, ids, weights)

    def ref():
        e = rot.next()[0]
        return reference.fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids)

    variants = {"topg": topg, "hf grouped_mm": lambda: hf("grouped_mm")}
    if not (quick and heavy):  # seconds per call in bf16 at 512 tokens
        variants.update({"hf eager": lambda: hf("eager"), "reference": ref})
    case = f"T={tokens} E={E} k={K} H={H} I={INTER}"
    with torch.inference_mode():
        if check:  # the layouts agree: topg takes gate_up_proj / down_proj as they are
            e = rot.first[0]
            e.config._experts_implementation = "eager"
            got = torch_topg.ops.fused_moe(x, e.gate_up_proj, e.down_proj, weights, ids)
            torch.testing.assert_close(got, e(x, ids, weights), atol=1e-4, rtol=1e-4)
        if not heavy:
            return measure("moe", "fused_moe", case, dname, variants, quick=quick,
                           target=("limit", 0.8), rotation=rot,
                           dram_bytes=hit_bytes + tokens * H * elt)  # fmt: skip
        target = ("hf grouped_mm", 1.2 if dtype == torch.float32 else 4.0)
        return measure("moe", "fused_moe", case, dname, variants, quick=quick, heavy=True,
                       target=target, flops=2.0 * tokens * K * 3 * H * INTER)  # fmt: skip


def run(quick: bool) -> list[Row]:
    rows = []
    token_counts = [1, 8, 512] if quick else [1, 2, 4, 8, 512]
    for dname, dtype in DTYPES.items():
        pool: list = []
        for tokens in token_counts:
            check = dtype == torch.float32 and tokens == token_counts[0]
            rows.append(_case(pool, dtype, tokens, dname, check, quick))
    return rows


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        print(row.key, {k: v.fmt() for k, v in row.ratios.items()}, row.regime, row.verdict)
