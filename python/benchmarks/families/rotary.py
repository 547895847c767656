"""rotary_embedding vs Hugging Face LlamaRotaryEmbedding + apply_rotary_pos_emb.

Run warm (q and k are the QKV projection's fresh output): every row is "in cache" (the
largest, T=512 llama8b fp32, is 10 MiB) and not compared with the DRAM limit.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import torch_topg
from torch_topg.bench.rows import Row, measure

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
                # In place: q, k and T rows of the cos/sin cache come from DRAM; q and k
                # are written back (not counted: see torch_topg/bench/rows.py).
                nbytes = (qt.numel() + kt.numel()) * qt.element_size()
                nbytes += tokens * d * cache.element_size()
                with torch.inference_mode():
                    rows.append(measure(
                        "rotary", "rotary_embedding", f"{name} T={tokens} Hq={hq} Hkv={hk} D={d}",
                        dname,
                        {"topg": lambda: torch_topg.ops.rotary_embedding(p1, qt, kt, d, cache, True),
                         "hf rotary module + apply": hf_full,
                         "hf apply_rotary_pos_emb": lambda: apply_rotary_pos_emb(q, k, cos, sin)},
                        quick=quick, dram_bytes=nbytes,
                        target=("hf apply_rotary_pos_emb", 1.5) if tokens == 1 else None,
                    ))  # fmt: skip
    return rows


if __name__ == "__main__":
    for row in run(quick=True):
        print(row.key, {k: v.fmt() for k, v in row.ratios.items()}, row.regime, row.verdict)
