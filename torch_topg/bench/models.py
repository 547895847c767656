"""What a decoder model costs, from its config and tensors: the limits of its steps.

* ``weights_bytes(model)``: the bytes of its parameters and buffers (shared storage once).
* ``decode_read_bytes(model, context)``: what one decode step must read: every weight
  once (a mixture of experts: only the top-k experts' weights) plus the KV cache at
  ``context`` tokens; over the read bandwidth, the step's physical floor.
* ``decoder_shape(config)`` and ``round_flops(shape, prompt_lens, new_tokens)``: the
  FLOPs of generating ``new_tokens`` after each prompt, for a rate against the GEMM peak.
"""

from __future__ import annotations

from typing import Any

import torch


def weights_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage counted once."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def decode_read_bytes(model: torch.nn.Module, context: int) -> int:
    """Bytes a batch-1 decode step must read at ``context`` tokens: every weight once
    (the tied embedding counts once: as the LM head; the embedding lookup reads one row)
    plus the KV cache; of a mixture of experts only the top-k experts' weights."""
    cfg: Any = model.config
    w = weights_bytes(model)
    elt = next(model.parameters()).element_size()
    kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * kv_heads * head_dim * context * elt
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:  # a decode token reads only its top-k experts' weights
        k = cfg.num_experts_per_tok
        inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        per_expert = 3 * cfg.hidden_size * inter * elt
        w -= cfg.num_hidden_layers * (experts - k) * per_expert
    return w + kv


def decoder_shape(config: Any) -> dict:
    """The sizes of a dense Llama-like decoder's config that its FLOPs depend on."""
    c = config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i, kv, q = c.hidden_size, c.intermediate_size, c.num_key_value_heads, c.num_attention_heads
    per_layer = h * q * hd + 2 * h * kv * hd + q * hd * h + 3 * h * i + 2 * h  # attn, mlp, norms
    non_emb = c.num_hidden_layers * per_layer + h  # + final norm; tied LM head not counted
    return {
        "layers": c.num_hidden_layers,
        "hidden": h,
        "heads": q,
        "kv_heads": kv,
        "head_dim": hd,
        "vocab": c.vocab_size,
        "params_non_embedding": non_emb,
        "params_embedding": c.vocab_size * h,
        "tied": bool(getattr(c, "tie_word_embeddings", False)),
    }


def round_flops(shape: dict, prompt_lens: list[int], new_tokens: int) -> float:
    """FLOPs of one round: per request, every prompt token and every generated token but
    the last passes the model once (T = P + G - 1 positions):
    2 * N_non_emb * T + 4 * L * H_q * d_head * sum_{t=1..T} t (QK^T and PV, causal)."""
    n, attn = (
        shape["params_non_embedding"],
        4 * shape["layers"] * shape["heads"] * shape["head_dim"],
    )
    total = 0.0
    for p in prompt_lens:
        t = p + new_tokens - 1
        total += 2 * n * t + attn * t * (t + 1) / 2
    return total
