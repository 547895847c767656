"""Shape classes and feature keys: what a dispatch decision depends on.

``classify(op, args, kwargs)`` returns ``(shape_class, features)``:

* the **shape class**, a short string that the tuning table is keyed by (with the op). It
  starts with the dtype and holds the sizes that move the ranking of the candidates,
  sizes that vary call to call in power-of-two buckets (:func:`bucket`):

  ========================  ====================================================================
  op                        class
  ========================  ====================================================================
  ``attention``             ``bf16 d128 g4 s4096``: dtype, head_dim, GQA ratio Hq/Hkv, query
                            length bucket (dense: Sq; ragged: ``max_seqlen_q``, else the tokens)
  ``paged_attention``       ``bf16 kvbf16 d128 g4 b32 ctx8192 q1``: dtype, cache dtype, head_dim,
                            GQA ratio, batch bucket, context bucket (the block table's capacity:
                            ``seq_lens`` are on the device), query rows per sequence bucket
  ``fused_moe``             ``bf16 e8 k2 i16384 t16``: dtype, experts, top-k, expert width bucket,
                            token bucket
  ``linear``                ``bf16 m4``: dtype, rows bucket (all dims but the last)
  ========================  ====================================================================

* the **features**, a tuple of everything else a candidate's ``supports`` reads (device,
  causal, window, softcap, sinks, mask, varlen, activation, bias, capture state, ...), so that a
  decision cached per (op, class, features) is right for every call with that key.

Reading these is a few attribute reads: no device value is read, nothing synchronises.
"""

from __future__ import annotations

from typing import Any

import torch

_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "int8"}


def short_dtype(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"`` (others: their torch name)."""
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def bucket(n: int) -> int:
    """The smallest power of two ``>= n`` (``0`` for ``n <= 0``): 1, 2, 4, ..., 4096, ..."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def _device(t: torch.Tensor) -> tuple[str, int | None]:
    return (t.device.type, t.device.index)


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def attention_class(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any
) -> tuple[str, tuple]:
    ragged = kw.get("cu_seqlens_q") is not None
    d, hq, hkv = query.shape[-1], query.shape[-2], key.shape[-2]
    if ragged:
        seq = kw.get("max_seqlen_q") or query.shape[0]
        sq, sk, batch = seq, kw.get("max_seqlen_k") or key.shape[0], 1
    else:
        batch, sq, sk = query.shape[0], query.shape[1], key.shape[1]
    group = hq // hkv if hkv else 0
    cls = f"{short_dtype(query.dtype)} d{d} g{group} s{bucket(sq)}"
    mask = kw.get("mask")
    features = (
        _device(query),
        ragged,
        bool(kw.get("causal", False)),
        sq == sk,
        kw.get("window_left", -1) >= 0,
        kw.get("softcap", 0.0) > 0,
        None if mask is None else mask.dtype,
        batch == 0 or sq == 0 or sk == 0 or hq == 0 or d == 0,
        query.dim(),
        kw.get("sinks") is not None,
    )
    return cls, features


def paged_attention_class(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    **kw: Any,
) -> tuple[str, tuple]:
    ragged = kw.get("cu_seqlens_q") is not None
    seqs = seq_lens.shape[0]
    rows = -(-query.shape[0] // seqs) if ragged and seqs else 1
    d, hq, hkv = query.shape[-1], query.shape[-2], key_cache.shape[-2]
    capacity = block_tables.shape[1] * key_cache.shape[1]
    cls = (
        f"{short_dtype(query.dtype)} kv{short_dtype(key_cache.dtype)} d{d} "
        f"g{hq // hkv if hkv else 0} b{bucket(seqs)} ctx{bucket(capacity)} q{bucket(rows)}"
    )
    features = (
        _device(query),
        ragged,
        kw.get("window_left", -1) >= 0,
        kw.get("softcap", 0.0) > 0,
        query.shape[0] == 0,
        kw.get("sinks") is not None,
    )
    return cls, features


def fused_moe_class(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    **kw: Any,
) -> tuple[str, tuple]:
    t, k = topk_ids.shape[0], topk_ids.shape[-1]
    e, h, inter = w_gate_up.shape[0], hidden_states.shape[-1], w_down.shape[-1]
    cls = f"{short_dtype(hidden_states.dtype)} e{e} k{k} i{bucket(inter)} t{bucket(t)}"
    features = (
        _device(hidden_states),
        kw.get("activation", "silu"),
        topk_weights.dtype,
        h % 8 == 0 and inter % 8 == 0,
        t == 0 or k == 0,
        topk_ids.numel() >= 2**31 - 1,
        _capturing(hidden_states),
    )
    return cls, features


def linear_class(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> tuple[str, tuple]:
    k = input.shape[-1]
    m = input.numel() // k if k else 0
    cls = f"{short_dtype(input.dtype)} m{bucket(m)}"
    return cls, (_device(input), bias is not None)


CLASSIFIERS = {
    "attention": attention_class,
    "paged_attention": paged_attention_class,
    "fused_moe": fused_moe_class,
    "linear": linear_class,
}


def classify(op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, tuple]:
    """``(shape class, features)`` of a call of ``topg::<op>``; see the module docstring."""
    return CLASSIFIERS[op](*args, **kwargs)
