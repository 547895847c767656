"""fused_moe vs transformers 5 Mixtral experts (grouped_mm and eager) and the reference.

Mixtral-like small config: 8 experts, top-2, H=1024, I=1408. Decode (1..8 tokens) is
memory-bound: the limit is the bytes of the experts hit over the measured read bandwidth.
512 tokens is compute-bound: the limit is the FLOPs over torch's measured fp32 GEMM rate.
"""

from __future__ import annotations

import torch
from common import Row, bench, bw_limit_ms, gemm_limit_ms, ms

import torch_topg
from torch_topg import reference

E, K, H, INTER = 8, 2, 1024, 1408
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixtral_experts(dtype: torch.dtype) -> torch.nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=K
    )
    experts = MixtralExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, H**-0.5)
        experts.down_proj.normal_(0, INTER**-0.5)
    return experts.to(dtype).eval()


def routing(tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, E, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), K)
    return weights / weights.sum(-1, keepdim=True), ids


def _time(fn, heavy: bool) -> float:
    return ms(bench(fn, warmup=1, min_runs=3, min_time_s=0.0) if heavy else bench(fn))


def _case(experts: torch.nn.Module, tokens: int, dname: str, check: bool, quick: bool) -> Row:
    dtype = experts.gate_up_proj.dtype
    wgu, wd = experts.gate_up_proj.detach(), experts.down_proj.detach()
    heavy = tokens > 64
    x = torch.randn(tokens, H).to(dtype)
    weights, ids = routing(tokens)

    def topg():
        return torch_topg.ops.fused_moe(x, wgu, wd, weights, ids)

    def hf(impl: str):
        experts.config._experts_implementation = impl
        return experts(x, ids, weights)

    with torch.inference_mode():
        if check:  # the layouts agree: topg takes gate_up_proj / down_proj as they are
            torch.testing.assert_close(topg(), hf("eager"), atol=1e-4, rtol=1e-4)
        t_topg = _time(topg, heavy)
        base = {"hf grouped_mm": _time(lambda: hf("grouped_mm"), heavy)}
        if not (quick and heavy):  # seconds per call in bf16 at 512 tokens
            base["hf eager"] = _time(lambda: hf("eager"), heavy)
            base["reference"] = _time(lambda: reference.fused_moe(x, wgu, wd, weights, ids), heavy)
    if tokens <= 64:
        hit = int(ids.unique().numel())
        nbytes = hit * (wgu[0].numel() + wd[0].numel()) * wgu.element_size()
        limit, kind, target = bw_limit_ms(nbytes), "read bw", ("limit", 0.8)
    else:
        limit, kind = gemm_limit_ms(2.0 * tokens * K * 3 * H * INTER), "gemm"
        target = ("hf grouped_mm", 1.2 if dtype == torch.float32 else 4.0)
    case = f"T={tokens} E={E} k={K} H={H} I={INTER}"
    return Row("moe", "fused_moe", case, dname, t_topg, base, limit, kind, target)


def run(quick: bool) -> list[Row]:
    rows = []
    token_counts = [1, 8, 512] if quick else [1, 2, 4, 8, 512]
    for dname, dtype in DTYPES.items():
        experts = mixtral_experts(dtype)
        for tokens in token_counts:
            check = dtype == torch.float32 and tokens == token_counts[0]
            rows.append(_case(experts, tokens, dname, check, quick))
    return rows


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        ratios = {name: f"{row.ratio(name):.2f}x" for name in row.baselines}
        print(f"{row.case:<34} {row.dtype} topg {row.topg_ms:8.3f} ms  {ratios}  "
              f"limit {row.ratio('limit'):.0%} {row.limit_kind}  ok={row.ok}")  # fmt: skip
