"""Small awkward cases of every CUDA kernel, run once: for compute-sanitizer memcheck.

    compute-sanitizer --tool memcheck --error-exitcode 3 python3 sanitize_cases.py

Sizes hit the tails: head_dim 20 / 80, hidden sizes not multiples of 8, contexts across
block and partition boundaries, GEMM tiles with partial rows and columns.
"""

from __future__ import annotations

import torch

import torch_topg
from torch_topg import _native


def main() -> None:
    assert _native.is_loaded(), _native.missing_reason("cuda")
    dev, ops = "cuda", torch_topg.ops
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        r = lambda *s: torch.randn(*s, device=dev).to(dtype)  # noqa: E731
        ops.rms_norm(r(3, 123), r(123), 1e-6)
        ops.rms_norm(r(2, 4096), r(4096), 1e-6)
        ops.fused_add_rms_norm(r(5, 17), r(5, 17), r(17), 1e-6)
        ops.silu_and_mul(r(3, 26))
        ops.gelu_and_mul(r(2, 2 * 1536), approximate="tanh")
        cache = torch.randn(40, 80, device=dev)
        pos = torch.tensor([0, 39, 7], device=dev)
        ops.rotary_embedding(pos, r(3, 2 * 80), r(3, 80), 80, cache, True)
        ops.rotary_embedding(pos, r(3, 2 * 80), None, 80, cache[:, :40].contiguous(), False)
        kc, vc = r(7, 16, 2, 80), r(7, 16, 2, 80)
        ops.reshape_and_cache(
            r(3, 2, 80), r(3, 2, 80), kc, vc, torch.tensor([0, -1, 111], device=dev)
        )
        bt = torch.randperm(7, device=dev)[:6].view(2, 3).int()
        sl = torch.tensor([33, 0], device=dev, dtype=torch.int32)
        ops.paged_attention(r(2, 6, 80), kc, vc, bt, sl, window_left=20)
        kq, vq = (torch.zeros(7, 16, 2, 80, dtype=torch.int8, device=dev) for _ in range(2))
        ks, vs = (torch.zeros(7, 16, 2, device=dev) for _ in range(2))
        s8 = {"key_scale": ks, "value_scale": vs}  # the int8 KV cache
        ops.reshape_and_cache(
            r(3, 2, 80), r(3, 2, 80), kq, vq, torch.tensor([0, -1, 111], device=dev), **s8
        )
        ops.paged_attention(r(2, 6, 80), kq, vq, bt, sl, window_left=20, **s8)
        kc2, vc2 = r(40, 16, 1, 128), r(40, 16, 1, 128)
        bt2 = torch.randperm(40, device=dev).view(1, 40).int()
        ops.paged_attention(
            r(1, 12, 128), kc2, vc2, bt2, torch.tensor([601], device=dev, dtype=torch.int32)
        )
        ops.attention(r(1, 9, 4, 20), r(1, 13, 2, 20), r(1, 13, 2, 20), causal=True)
        ops.attention(
            r(2, 17, 2, 256),
            r(2, 17, 2, 256),
            r(2, 17, 2, 256),
            mask=torch.rand(2, 1, 17, 17, device=dev) > 0.5,
        )
        w, ids = ops.moe_topk(r(5, 33), 3, renormalize=True)
        ops.fused_moe(r(5, 100), r(33, 2 * 40, 100), r(33, 100, 40), w, ids)
        ops.linear(r(3, 100), r(65, 100), r(65))
        ops.linear(r(67, 100), r(65, 100), None)
    torch.cuda.synchronize()
    print("sanitize cases: all ran")


if __name__ == "__main__":
    main()
