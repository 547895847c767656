"""Attention ops: ``attention`` (prefill), ``paged_attention`` (decode) and
``reshape_and_cache`` (writing new K/V into the paged cache)."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.ops._checks import Arg, check_op, describe
from torch_topg.ops._library import eager_entry, register

_attention = eager_entry("attention")
_paged_attention = eager_entry("paged_attention")
_reshape_and_cache = eager_entry("reshape_and_cache")


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    mask: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill attention (FlashAttention semantics), dense or ragged.

    Args:
        query: dense ``[B, Sq, Hq, D]`` or ragged ``[Tq, Hq, D]``.
        key, value: dense ``[B, Sk, Hkv, D]`` or ragged ``[Tk, Hkv, D]``; same dtype as
            ``query`` (float32 / bfloat16 / float16). Only the last dimension of q/k/v
            must be contiguous (a transposed view of ``[B, H, S, D]`` works, no copy).
            ``Hq % Hkv == 0``: query head ``h`` uses kv head ``h // (Hq // Hkv)``
            (GQA / MQA).
        cu_seqlens_q: ragged only, int32 ``[B + 1]``, cumulative lengths from 0 to ``Tq``.
        cu_seqlens_k: ragged only, int32 ``[B + 1]`` from 0 to ``Tk``; None = the same
            as ``cu_seqlens_q``.
        causal: bottom-right aligned (FlashAttention 2.1+): query ``i`` of a sequence
            sees key ``j`` iff ``j <= i + Sk - Sq``.
        scale: score scale, default ``1 / sqrt(D)``.
        window_left: ``>= 0`` also requires ``j >= i + Sk - Sq - window_left`` (with or
            without ``causal``); ``-1`` = unlimited.
        softcap: ``> 0``: scores become ``softcap * tanh(s / softcap)`` (Gemma-2),
            before masking.
        mask: dense only; bool (True = may attend) or floating additive, broadcastable
            to ``[B, Hq, Sq, Sk]``; combined with ``causal`` / ``window_left``.
        max_seqlen_q, max_seqlen_k: ragged only, the longest query / key sequence (as
            in flash-attn's varlen API). On CUDA they size the launch without reading
            ``cu_seqlens`` back to the host (no synchronisation; without them the CUDA
            kernel copies the offsets to the host). A value below the true maximum is
            an error where the offsets are read (CPU, reference, CUDA with
            ``torch_topg.index_checks()``); otherwise the rows past it are left
            uninitialised. CUDA-graph capture of ragged attention needs them.
        sinks: None, or contiguous float32 ``[Hq]`` on the query's device: attention
            sinks (GPT-OSS). Query head ``h``'s softmax gets one more logit, ``sinks[h]``,
            with no value: ``out = sum_j e^(s_j - M) v_j / (sum_j e^(s_j - M) +
            e^(sinks[h] - M))``, ``M = max(max_j s_j, sinks[h])``, where ``s_j`` are the
            visible keys' scores after scale, softcap and mask (the sink itself is not
            soft-capped). The weights then sum to less than one.

    Returns:
        Contiguous ``[B, Sq, Hq, D]`` (dense) or ``[Tq, Hq, D]`` (ragged) in the dtype of
        ``query``. A query that sees no key outputs zeros. Math is fp32 (online softmax
        over key tiles, never the full score matrix), rounded once.
    """
    op = torch.ops.topg.attention.default if torch.compiler.is_compiling() else _attention
    return op(
        query,
        key,
        value,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        causal=causal,
        scale=scale,
        window_left=window_left,
        softcap=softcap,
        mask=mask,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
        sinks=sinks,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens over a paged KV cache (vLLM layout), read in place.

    Without ``cu_seqlens_q``: decode, one query token per sequence. With it: several
    new tokens per sequence (a prefill chunk, the tokens after a prefix-cache hit,
    speculative tokens to verify), causal among themselves, with no gather of the cache.

    Args:
        query: ``[num_seqs, Hq, D]`` (one token per sequence) or, with ``cu_seqlens_q``,
            ``[Tq, Hq, D]``; float32 / bfloat16 / float16, last dim contiguous.
        key_cache, value_cache: contiguous ``[num_blocks, block_size, Hkv, D]``, the
            dtype of ``query``, or both int8 (a quantised cache written by
            :func:`reshape_and_cache` with scales); ``Hq % Hkv == 0``.
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``: token ``t`` of sequence
            ``s`` lives in block ``block_tables[s, t // block_size]`` at offset
            ``t % block_size``. The first ``ceil(seq_len / block_size)`` ids of a row
            must be in ``[0, num_blocks)``.
        seq_lens: int32 ``[num_seqs]``: cached tokens including the new ones (their K/V
            are already in the cache), at most ``max_blocks_per_seq * block_size``.
        cu_seqlens_q: None, or int32 ``[num_seqs + 1]`` on the query's device,
            non-decreasing offsets from 0 to ``Tq``: sequence ``s`` owns query rows
            ``cu_seqlens_q[s] .. cu_seqlens_q[s + 1] - 1`` (``q_len`` of them, 0 allowed,
            at most ``seq_lens[s]``), the *last* ``q_len`` tokens of the sequence.
        scale, window_left, softcap: as in :func:`attention`. Query row ``i`` (0-based
            within its sequence) sits at position ``p = seq_len - q_len + i`` and sees
            keys ``max(0, p - window_left) .. p`` (``0 .. p`` when ``window_left == -1``):
            causal, bottom-right aligned. Without ``cu_seqlens_q``, ``q_len = 1``.
        key_scale, value_scale: with int8 caches (and only then), contiguous float32
            ``[num_blocks, block_size, Hkv]``: cached token ``t``'s kv head ``h`` holds
            ``cache[.., t, h, :] * scale[.., t, h]`` (``reference.dequantize_kv``).
        sinks: None, or contiguous float32 ``[Hq]``: one learned logit per query head in
            the softmax, with no value (as in :func:`attention`).

    Returns:
        The shape of ``query`` in its dtype; zeros for a query that sees no key
        (``seq_len == 0``). A row's result depends only on its own query, sequence and
        position: it is bitwise the same whatever else is in the batch, and a decode row
        equals the same token given as a ragged row.
    """
    if torch.compiler.is_compiling():
        op = torch.ops.topg.paged_attention.default
    else:
        op = _paged_attention
    return op(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q=cu_seqlens_q,
        scale=scale,
        window_left=window_left,
        softcap=softcap,
        key_scale=key_scale,
        value_scale=value_scale,
        sinks=sinks,
    )


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    """In place: write token ``t``'s K/V into cache slot ``slot_mapping[t]``.

    Args:
        key, value: ``[T, Hkv, D]``, last dim contiguous, float32 / bfloat16 / float16.
        key_cache, value_cache: contiguous ``[num_blocks, block_size, Hkv, D]``;
            ``slot = block * block_size + offset``. The dtype of ``key`` (an exact
            copy), or int8: each row of ``D`` values (one token, one kv head) is
            quantised (``reference.quantize_kv``: ``scale = max|x| / 127``,
            ``round_half_even(x / scale)`` in fp32) and its scale written beside it.
        slot_mapping: int64 (or int32) ``[T]``; a negative slot skips the token (vLLM
            padding); slots must be below ``num_blocks * block_size``.
        key_scale, value_scale: with int8 caches (and only then), contiguous float32
            ``[num_blocks, block_size, Hkv]``, written in place.
    """
    if torch.compiler.is_compiling():
        torch.ops.topg.reshape_and_cache.default(
            key, value, key_cache, value_cache, slot_mapping,
            key_scale=key_scale, value_scale=value_scale,
        )  # fmt: skip
    else:
        _reshape_and_cache(
            key, value, key_cache, value_cache, slot_mapping,
            key_scale=key_scale, value_scale=value_scale,
        )  # fmt: skip


# --- argument checks (shared by the fake kernel and the reference fallback) ----------


def _check_qkv(
    op: str,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    nd: int,
    names: tuple[str, str] = ("key", "value"),
) -> None:
    """q and k/v (named ``names``) with ``nd`` dims ``[..., H, D]``: dtypes, GQA, head_dim.
    A paged cache (``names`` = the caches) may be int8 instead of the query's dtype."""
    kn, vn = names
    Arg(op, "query", query).floating().last_dim_contiguous()
    Arg(op, kn, key).dim(nd)
    if kn == "key_cache":
        _cache_dtype(op, key, query, "query")
    else:
        Arg(op, kn, key).same_dtype(query, "query")
    Arg(op, kn, key).same_device(query, "query")
    Arg(op, kn, key).last_dim_contiguous().size(nd - 1, query.shape[-1], "head_dim of 'query'")
    like = (key, kn) if kn == "key_cache" else (query, "query")
    Arg(op, vn, value).dim(nd).same_dtype(*like).same_device(query, "query")
    Arg(op, vn, value).last_dim_contiguous()
    for d in range(nd - 1):
        Arg(op, vn, value).size(d, key.shape[d], f"the shape of '{kn}'")
    Arg(op, vn, value).size(nd - 1, query.shape[-1], "head_dim of 'query'")
    hq, hkv = query.shape[-2], key.shape[-2]
    torch._check(
        hkv > 0 and hq % hkv == 0,
        lambda: f"topg::{op}: query heads ({hq}) must be a multiple of key/value heads ({hkv})",
    )


def _cache_dtype(op: str, cache: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """``key_cache``: the dtype of ``like`` (the query or the key), or int8."""
    if cache.dtype not in (like.dtype, torch.int8):
        Arg(op, "key_cache", cache).fail(
            f"dtype {str(like.dtype).removeprefix('torch.')} (the dtype of '{like_name}') or "
            "int8 (with 'key_scale' and 'value_scale')"
        )


def _check_scales(
    op: str,
    key_cache: torch.Tensor,
    key_scale: torch.Tensor | None,
    value_scale: torch.Tensor | None,
) -> None:
    """int8 caches need both scales ``[num_blocks, block_size, Hkv]`` float32; others none."""
    quant = key_cache.dtype == torch.int8
    for name, scale in (("key_scale", key_scale), ("value_scale", value_scale)):
        if scale is None:
            check_op(
                not quant,
                op,
                f"argument '{name}' expected a float32 tensor [num_blocks, block_size, "
                "kv_heads] with int8 caches, got None",
            )
            continue
        a = Arg(op, name, scale)
        if not quant:
            a.fail(
                f"None with {str(key_cache.dtype).removeprefix('torch.')} caches (scales go with int8)"
            )
        a.dim(3).dtype([torch.float32]).same_device(key_cache, "key_cache").contiguous()
        for d in range(3):
            a.size(d, key_cache.shape[d], "the shape of 'key_cache'")


def _check_sinks(op: str, sinks: torch.Tensor | None, query: torch.Tensor) -> None:
    """``sinks``: None, or contiguous float32 ``[Hq]`` on the query's device."""
    if sinks is None:
        return
    a = Arg(op, "sinks", sinks).dim(1).dtype([torch.float32]).same_device(query, "query")
    a.size(0, query.shape[-2], "the query heads of 'query'").contiguous()


def _check_cu_seqlens(name: str, cu: torch.Tensor, query: torch.Tensor, batch) -> None:
    a = Arg("attention", name, cu).dim(1).dtype([torch.int32]).same_device(query, "query")
    if batch is not None:
        a.size(0, batch, "batch + 1, the size of 'cu_seqlens_q'")


def _check_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    mask: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    op = "attention"
    ragged = cu_seqlens_q is not None
    Arg(op, "query", query).dim(3 if ragged else 4)
    _check_qkv(op, query, key, value, 3 if ragged else 4)
    check_op(window_left >= -1, op, f"window_left must be >= -1, got {window_left}")
    check_op(softcap >= 0, op, f"softcap must be >= 0, got {softcap:g}")
    _check_sinks(op, sinks, query)
    if ragged:
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, query, None)
        n = cu_seqlens_q.shape[0]
        if n == 0 or (n == 1 and query.shape[0] > 0):  # a shape fact
            Arg(op, "cu_seqlens_q", cu_seqlens_q).fail(
                f"non-decreasing offsets from 0 to {query.shape[0]} (the token count)"
            )
        if mask is not None:
            Arg(op, "mask", mask).fail("None with ragged (cu_seqlens) input")
        if cu_seqlens_k is not None:
            _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, query, cu_seqlens_q.shape[0])
        else:
            torch._check(
                key.shape[0] == query.shape[0],
                lambda: (
                    f"topg::{op}: argument 'key' {describe(key)} expected {query.shape[0]} "
                    "tokens (the tokens of 'query', as 'cu_seqlens_k' is None)"
                ),
            )
        for name, v in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
            check_op(v is None or v >= 0, op, f"argument '{name}' expected a value >= 0, got {v}")
        return
    if cu_seqlens_k is not None:
        Arg(op, "cu_seqlens_k", cu_seqlens_k).fail("None without 'cu_seqlens_q'")
    for name, v in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        check_op(v is None, op, f"argument '{name}' expected None without 'cu_seqlens_q'")
    Arg(op, "key", key).size(0, query.shape[0], "the batch of 'query'")
    if mask is not None:
        m = Arg(op, "mask", mask).same_device(query, "query")
        if mask.dtype != torch.bool:
            m.floating()
        if mask.dim() > 4:
            m.fail("at most 4 dimensions (broadcastable to [B, Hq, Sq, Sk])")
        full = (query.shape[0], query.shape[2], query.shape[1], key.shape[1])
        for d in range(1, mask.dim() + 1):
            size, want = mask.shape[-d], full[-d]
            torch._check(
                size == 1 or size == want,
                lambda: (
                    f"topg::{op}: argument 'mask' (shape {list(mask.shape)}) expected "
                    f"a shape broadcastable to [B, Hq, Sq, Sk] = {list(full)}"
                ),
            )


def _check_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    op = "paged_attention"
    Arg(op, "query", query).dim(3)
    _check_qkv(op, query, key_cache, value_cache, 4, ("key_cache", "value_cache"))
    Arg(op, "key_cache", key_cache).contiguous()
    Arg(op, "value_cache", value_cache).contiguous()
    torch._check(
        key_cache.shape[1] > 0,
        Arg(op, "key_cache", key_cache).message(
            "a block size (size at dim 1) of at least one token"
        ),
    )
    Arg(op, "block_tables", block_tables).dim(2).dtype([torch.int32]).same_device(query, "query")
    Arg(op, "seq_lens", seq_lens).dim(1).dtype([torch.int32]).same_device(query, "query")
    if cu_seqlens_q is None:  # one query token per sequence
        Arg(op, "block_tables", block_tables).size(0, query.shape[0], "num_seqs of 'query'")
        Arg(op, "seq_lens", seq_lens).size(0, query.shape[0], "num_seqs of 'query'")
    else:  # ragged: num_seqs from seq_lens; the offsets' values are checked by the kernels
        ns = seq_lens.shape[0]
        Arg(op, "block_tables", block_tables).size(0, ns, "num_seqs of 'seq_lens'")
        cu = Arg(op, "cu_seqlens_q", cu_seqlens_q).dim(1).dtype([torch.int32])
        cu.same_device(query, "query").size(0, ns + 1, "num_seqs + 1, from 'seq_lens'")
    check_op(window_left >= -1, op, f"window_left must be >= -1, got {window_left}")
    check_op(softcap >= 0, op, f"softcap must be >= 0, got {softcap:g}")
    _check_scales(op, key_cache, key_scale, value_scale)
    _check_sinks(op, sinks, query)


def _check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    key_scale: torch.Tensor | None = None,
    value_scale: torch.Tensor | None = None,
) -> None:
    op = "reshape_and_cache"
    Arg(op, "key", key).dim(3).floating().last_dim_contiguous()
    Arg(op, "value", value).dim(3).same_dtype(key, "key").last_dim_contiguous()
    Arg(op, "key_cache", key_cache).dim(4)
    _cache_dtype(op, key_cache, key, "key")
    Arg(op, "key_cache", key_cache).contiguous()
    Arg(op, "value_cache", value_cache).dim(4).same_dtype(key_cache, "key_cache").contiguous()
    for name, t in (("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        Arg(op, name, t).same_device(key, "key")
    for d in range(3):
        Arg(op, "value", value).size(d, key.shape[d], "the shape of 'key'")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        Arg(op, name, t).size(2, key.shape[1], "kv heads of 'key'")
        Arg(op, name, t).size(3, key.shape[2], "head_dim of 'key'")
    for d in range(2):
        Arg(op, "value_cache", value_cache).size(d, key_cache.shape[d], "the shape of 'key_cache'")
    Arg(op, "slot_mapping", slot_mapping).dim(1).index().same_device(key, "key")
    Arg(op, "slot_mapping", slot_mapping).size(0, key.shape[0], "tokens of 'key'")
    _check_scales(op, key_cache, key_scale, value_scale)


def _empty_out(query: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


register(
    "attention",
    check=_check_attention,
    fake=_empty_out,
    reference=reference.attention,
    wrapper=attention,
)
register(
    "paged_attention",
    check=_check_paged_attention,
    fake=_empty_out,
    reference=reference.paged_attention,
    wrapper=paged_attention,
)
register(
    "reshape_and_cache",
    check=_check_reshape_and_cache,
    fake=lambda *args, **kwargs: None,
    reference=reference.reshape_and_cache,
    wrapper=reshape_and_cache,
)
