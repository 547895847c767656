"""The engine's attention: transformers' attention interface routed to the paged cache.

The engine runs the model's own transformers code with ``attn_implementation=
"topg_paged"``. Every attention layer then calls :func:`paged_attention_forward` with its
projected, rotated ``query`` / ``key`` / ``value`` for the packed batch (all sequences'
new tokens side by side as one row: ``[1, H, T, D]``) and the step's metadata in
``**kwargs`` (transformers passes the model's extra keyword arguments down to the
attention function). The function writes the new K/V into the layer's paged cache
(``topg::reshape_and_cache`` at ``slot_mapping``) and attends over the cache in place
(``topg::paged_attention`` with ``cu_seqlens_q``: several causal queries per sequence).
No mask is built: the name is not in transformers' mask interface, so mask creation
exits early, and causality / sliding windows come from the positions. Attention sinks
(transformers' ``s_aux``, GPT-OSS) go to the kernel as ``sinks`` in float32.

Metadata (keyword arguments of the model call, all tensors so that a compiled step
takes them as graph inputs, never as constants):

- ``topg_kv_caches``: ``[k_0, v_0, k_1, v_1, ...]``, each ``[num_blocks, block_size,
  Hkv, D]``, indexed by the attention module's ``layer_idx``; with an int8 cache
  ``[k_0, v_0, ks_0, vs_0, ...]``, int8 K/V and their float32 scales ``[num_blocks,
  block_size, Hkv]``;
- ``topg_slot_mapping``: int64 ``[T]``, the cache slot of each new token;
- ``topg_block_tables``: int32 ``[S, max_blocks]``;
- ``topg_seq_lens``: int32 ``[S]``, cached tokens per sequence after this step;
- ``topg_cu_seqlens_q``: int32 ``[S + 1]``, offsets of each sequence's new tokens.
"""

from __future__ import annotations

from typing import Any

import torch

from torch_topg.ops.attention import attention, paged_attention, reshape_and_cache

ATTN_IMPLEMENTATION = "topg_paged"


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    softcap: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, Hq, T, D]`` -> ``[1, T, Hq, D]``."""
    caches = kwargs.get("topg_kv_caches")
    if caches is None and kwargs.get("topg_dense_cu_seqlens") is not None:
        return _dense_forward(module, query, key, value, scaling, softcap, sliding_window,
                              **kwargs)  # fmt: skip
    if caches is None:
        raise RuntimeError(
            "attn_implementation='topg_paged' runs only inside torch_topg.Engine (the "
            "model was called without the engine's paged-cache metadata)"
        )
    n = 4 if caches[0].dtype == torch.int8 else 2  # tensors per layer
    k_cache, v_cache, *scales = caches[n * module.layer_idx : n * module.layer_idx + n]
    ks, vs = scales or (None, None)
    q = query[0].transpose(0, 1)  # [T, Hq, D], last dim contiguous (a view)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    slots = kwargs["topg_slot_mapping"]
    reshape_and_cache(k, v, k_cache, v_cache, slots, key_scale=ks, value_scale=vs)
    # transformers' sliding_window W: a query at i sees keys j > i - W.
    window = sliding_window - 1 if sliding_window else -1
    # Attention sinks (transformers passes them as s_aux): one logit per query head.
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out = paged_attention(
        q,
        k_cache,
        v_cache,
        kwargs["topg_block_tables"],
        kwargs["topg_seq_lens"],
        cu_seqlens_q=kwargs["topg_cu_seqlens_q"],
        scale=scaling,
        window_left=window,
        softcap=float(softcap) if softcap else 0.0,
        key_scale=ks,
        value_scale=vs,
        sinks=sinks,
    )
    return out.unsqueeze(0), None


def _dense_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    softcap: float | None,
    sliding_window: int | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """No cache (embeddings, ``embed.py``): ragged causal attention over the packed
    prompts (``topg_dense_cu_seqlens``: int32 ``[S + 1]``; ``topg_max_seqlen``)."""
    cu = kwargs["topg_dense_cu_seqlens"]
    longest = kwargs.get("topg_max_seqlen")
    sinks = kwargs.get("s_aux")
    out = attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        cu_seqlens_q=cu, causal=True, scale=scaling,
        window_left=sliding_window - 1 if sliding_window else -1,
        softcap=float(softcap) if softcap else 0.0,
        max_seqlen_q=longest, max_seqlen_k=longest,
        sinks=sinks.float().contiguous() if sinks is not None else None,
    )  # fmt: skip
    return out.unsqueeze(0), None


_registered = False


def register_attention() -> None:
    """Register ``topg_paged`` in transformers' attention interface (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    _registered = True
