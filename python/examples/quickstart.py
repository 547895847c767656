"""A runnable tour of the topg ops on the CPU (uses the installed package).

    python python/examples/quickstart.py
"""

from __future__ import annotations

import torch

import torch_topg
from torch_topg import reference


def main() -> None:
    torch.manual_seed(0)
    print(f"native kernels loaded: {torch_topg.native_available()}")
    dt = torch.bfloat16

    # One decoder layer's worth of ops, decode step for a batch of 4 sequences.
    hidden, heads, kv_heads, head_dim, inter = 512, 8, 2, 64, 1024
    x = torch.randn(4, hidden, dtype=dt)
    residual = torch.randn(4, hidden, dtype=dt)
    norm_w = torch.ones(hidden, dtype=dt)
    torch_topg.ops.fused_add_rms_norm(x, residual, norm_w, 1e-6)  # in place

    w_qkv = torch.randn((heads + 2 * kv_heads) * head_dim, hidden, dtype=dt) * 0.02
    qkv = torch_topg.ops.linear(x, w_qkv)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()

    positions = torch.tensor([5, 17, 2, 30])
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
    torch_topg.ops.rotary_embedding(positions, q, k, head_dim, cos_sin, True)  # in place

    # Paged KV cache: 32 blocks of 16 tokens; each sequence owns some blocks.
    block_size = 16
    k_cache = torch.zeros(32, block_size, kv_heads, head_dim, dtype=dt)
    v_cache = torch.zeros_like(k_cache)
    block_tables = torch.arange(32, dtype=torch.int32).view(4, 8)[:, torch.randperm(8)]
    seq_lens = (positions + 1).to(torch.int32)
    # Fill the history, then write the new token at its slot.
    for s in range(4):
        for p in range(int(seq_lens[s])):
            blk = int(block_tables[s, p // block_size])
            k_cache[blk, p % block_size] = torch.randn(kv_heads, head_dim, dtype=dt)
            v_cache[blk, p % block_size] = torch.randn(kv_heads, head_dim, dtype=dt)
    slots = torch.stack(
        [block_tables[s, int(positions[s]) // block_size] * block_size + int(positions[s]) % block_size
         for s in range(4)]
    ).long()  # fmt: skip
    torch_topg.ops.reshape_and_cache(
        k.view(4, kv_heads, head_dim), v.view(4, kv_heads, head_dim), k_cache, v_cache, slots
    )
    out = torch_topg.ops.paged_attention(
        q.view(4, heads, head_dim), k_cache, v_cache, block_tables, seq_lens
    )
    expected = reference.paged_attention(
        q.view(4, heads, head_dim), k_cache, v_cache, block_tables, seq_lens
    )
    print(f"paged_attention max |topg - reference| = {(out - expected).abs().max().item():.2e}")

    # MoE: route 4 tokens to 2 of 8 experts and run them.
    experts = 8
    logits = torch.randn(4, experts)
    topk_w, topk_ids = torch_topg.ops.moe_topk(logits, 2, renormalize=True)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, dtype=dt) * 0.02
    w_down = torch.randn(experts, hidden, inter, dtype=dt) * 0.02
    y = torch_topg.ops.fused_moe(x, w_gate_up, w_down, topk_w, topk_ids)
    y_ref = reference.fused_moe(x, w_gate_up, w_down, topk_w, topk_ids)
    print(f"fused_moe max |topg - reference| = {(y - y_ref).abs().max().item():.2e}")

    # Prefill attention over a ragged batch of two prompts (7 and 12 tokens).
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    qp = torch.randn(19, heads, head_dim, dtype=dt)
    kp = torch.randn(19, kv_heads, head_dim, dtype=dt)
    vp = torch.randn(19, kv_heads, head_dim, dtype=dt)
    o = torch_topg.ops.attention(qp, kp, vp, cu_seqlens_q=cu, causal=True)
    o_ref = reference.attention(qp, kp, vp, cu_seqlens_q=cu, causal=True)
    print(f"ragged attention max |topg - reference| = {(o - o_ref).abs().max().item():.2e}")

    # Everything also compiles (fake kernels), with no graph break.
    f = torch.compile(lambda t: torch_topg.ops.silu_and_mul(t), fullgraph=True)
    print("compiled silu_and_mul:", tuple(f(torch.randn(3, 2 * inter)).shape))


if __name__ == "__main__":
    main()
