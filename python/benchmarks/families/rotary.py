"""rotary_embedding vs Hugging Face LlamaRotaryEmbedding + apply_rotary_pos_emb."""

from __future__ import annotations

import torch
from common import Row, bench, bw_limit_ms, ms
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import torch_topg

# (name, heads, kv heads, head_dim): SmolLM2-135M and a Llama-3-8B-like shape.
SHAPES = [("smollm2", 9, 3, 64), ("llama8b", 32, 8, 128)]


def run(quick: bool) -> list[Row]:
    rows = []
    for dname, dtype in {"fp32": torch.float32, "bf16": torch.bfloat16}.items():
        for name, hq, hk, d in SHAPES:
            for tokens in [1] if quick else [1, 512]:
                cfg = LlamaConfig(hidden_size=hq * d, num_attention_heads=hq,
                                  num_key_value_heads=hk, max_position_embeddings=4096)  # fmt: skip
                rope = LlamaRotaryEmbedding(cfg)
                pos = torch.arange(100, 100 + tokens)[None]
                # HF layout [B, H, S, D]; topg layout [T, H * D] (in place).
                q = torch.randn(1, hq, tokens, d, dtype=dtype)
                k = torch.randn(1, hk, tokens, d, dtype=dtype)
                inv = rope.inv_freq
                freqs = torch.outer(torch.arange(4096, dtype=torch.float32), inv)
                cache = torch.cat([freqs.cos(), freqs.sin()], -1).to(dtype)
                qt = torch.randn(tokens, hq * d, dtype=dtype)
                kt = torch.randn(tokens, hk * d, dtype=dtype)
                p1 = pos[0]

                def hf_full(q=q, k=k, pos=pos, rope=rope):
                    cos, sin = rope(q, pos)
                    return apply_rotary_pos_emb(q, k, cos, sin)

                cos, sin = rope(q, pos)
                with torch.inference_mode():
                    t_topg = ms(bench(lambda: torch_topg.ops.rotary_embedding(p1, qt, kt, d, cache, True)))  # fmt: skip
                    t_apply = ms(bench(lambda: apply_rotary_pos_emb(q, k, cos, sin)))
                    t_full = ms(bench(hf_full))
                nbytes = 2 * (qt.numel() + kt.numel()) * qt.element_size()
                rows.append(
                    Row("rotary", "rotary_embedding", f"{name} T={tokens} Hq={hq} Hkv={hk} D={d}",
                        dname, t_topg,
                        {"hf rotary module + apply": t_full, "hf apply_rotary_pos_emb": t_apply},
                        bw_limit_ms(nbytes), "read bw",
                        ("hf apply_rotary_pos_emb", 1.5) if tokens == 1 else None)
                )  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row)
