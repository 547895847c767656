"""The kernels furthest from their targets in the first GPU run (docs/gpu.md, Results), one
call each, for Nsight Compute (run by gpu_suite.sh, mode ``profile``):

    ncu --profile-from-start off --section SpeedOfLight ... python3 profile_cases.py

Every case runs twice first outside the profiled range (allocation, first-launch costs),
then once inside ``torch.cuda.profiler.start()`` / ``stop()`` (cudaProfilerStart/Stop,
which ``--profile-from-start off`` honours), so ncu sees exactly one launch of each case's
kernels. Shapes are the benchmark's (``bench_gpu.py``):

- ``paged_attention``: decode, bf16, B=32, Hq=32, Hkv=8, D=128, context 4096 (23% of the
  copy bandwidth; target 75%);
- ``attention``: prefill, bf16, causal, H=32, D=128, S=4096 (0.18x SDPA flash);
- ``fused_moe``: Mixtral shape, E=8, k=2, H=4096, I=14336, batch 1 (0.34x the eager loop);
- ``linear``: M=1, N=14336, K=4096 (0.74x cuBLAS).

``--device cpu`` checks the script's shapes at a small scale (no profiler calls).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import torch_topg

ops = torch_topg.ops


def cases(dev: str, small: bool) -> dict[str, Callable[[], object]]:
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32

    def r(*s: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*s, device=dev, generator=g) * scale).to(dt)

    B, ctx, hq, hkv, d, bs = (32, 4096, 32, 8, 128, 16) if not small else (2, 40, 4, 2, 16, 16)
    nb = B * (ctx // bs + 1)
    kc, vc = r(nb, bs, hkv, d), r(nb, bs, hkv, d)
    bt = torch.arange(nb, device=dev, dtype=torch.int32).view(B, -1)
    sl = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    q = r(B, hq, d)
    S, h = (4096, 32) if not small else (64, 4)
    qp, kp, vp = r(1, S, h, d), r(1, S, h, d), r(1, S, h, d)
    E, k, H, inter = (8, 2, 4096, 14336) if not small else (4, 2, 64, 96)
    x = r(1, H)
    wgu, wd = r(E, 2 * inter, H, scale=0.02), r(E, H, inter, scale=0.02)
    tw, ids = ops.moe_topk(torch.randn(1, E, device=dev, generator=g), k, renormalize=True)
    N, K = (14336, 4096) if not small else (96, 64)
    xl, wl = r(1, K), r(N, K, scale=0.02)
    return {
        "paged_attention": lambda: ops.paged_attention(q, kc, vc, bt, sl),
        "attention": lambda: ops.attention(qp, kp, vp, causal=True),
        "fused_moe": lambda: ops.fused_moe(x, wgu, wd, tw, ids),
        "linear": lambda: ops.linear(xl, wl),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    cuda = a.device == "cuda"
    for name, fn in cases(a.device, small=not cuda).items():
        for _ in range(2):
            fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            torch.cuda.nvtx.range_push(name)
        out = fn()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
            torch.cuda.profiler.stop()
        shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        print(f"{name}: ran, output {shape}")


if __name__ == "__main__":
    main()
