"""Reference semantics of the attention ops (plain PyTorch, fp32 math, one rounding).

The score matrix of one sequence is materialised here (this is the oracle, not the
kernel); everything is vectorised over heads, with a Python loop over sequences.
"""

from __future__ import annotations

import itertools
import math

import torch


def _visible(sq: int, sk: int, causal: bool, window_left: int, device: torch.device):
    """[sq, sk] bool: key j visible from query i (bottom-right aligned causal / window)."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)  # the query's key position
    j = torch.arange(sk, device=device)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if causal:
        ok &= j <= i
    if window_left >= 0:
        ok &= j >= i - window_left
    return ok


def _attend_one(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    window_left: int,
    softcap: float,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence. q: [Sq, Hq, D], k/v: [Sk, Hkv, D], mask: broadcastable to
    [Hq, Sq, Sk] or None, sinks: [Hq] or None. Returns fp32 [Sq, Hq, D].

    With ``sinks``, head h's softmax has one more logit, ``sinks[h]``, whose value is
    zero: the max M takes it in and the denominator gets ``exp(sinks[h] - M)``."""
    sq, hq, d = q.shape
    sk, hkv = k.shape[0], k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if sq == 0 or sk == 0:  # no query, or nothing to see: zeros
        return torch.zeros(sq, hq, d, device=q.device)
    group = hq // hkv
    k = k.float().repeat_interleave(group, dim=1)  # query head h uses kv head h // group
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~_visible(sq, sk, causal, window_left, q.device), float("-inf"))
    if mask is not None:
        if mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        else:
            s = s + mask.float()
    # Softmax where a row with no visible key gives zeros instead of NaN.
    m = s.amax(-1, keepdim=True)  # [Hq, Sq, 1]
    sink = None if sinks is None else sinks.float().view(hq, 1, 1).expand(hq, sq, 1)
    if sink is not None:  # a row that sees no key outputs zeros, whatever its sink
        sink = torch.where(m == float("-inf"), float("-inf"), sink)
        m = torch.maximum(m, sink)
    m = torch.where(torch.isinf(m) & (m < 0), torch.zeros_like(m), m)
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - m)
    p = e / torch.where(total == 0, torch.ones_like(total), total)
    return torch.einsum("hqk,khd->qhd", p, v)


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
    if cu_seqlens_q is None:  # dense [B, S, H, D]
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        full_mask = None
        if mask is not None:
            b, sq, hq, _ = query.shape
            full_mask = mask.expand(b, hq, sq, key.shape[1])
        for b in range(query.shape[0]):
            out[b] = _attend_one(
                query[b],
                key[b],
                value[b],
                causal,
                scale,
                window_left,
                softcap,
                None if full_mask is None else full_mask[b],
                sinks,
            ).to(query.dtype)
        return out
    cu_q = cu_seqlens_q.tolist()
    cu_k = cu_q if cu_seqlens_k is None else cu_seqlens_k.tolist()
    _check_cu_seqlens(cu_q, query.shape[0], "cu_seqlens_q")
    _check_cu_seqlens(cu_k, key.shape[0], "cu_seqlens_k")
    _check_max_seqlen(cu_q, max_seqlen_q, "max_seqlen_q")
    _check_max_seqlen(cu_k, max_seqlen_k, "max_seqlen_k")
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        out[q0:q1] = _attend_one(
            query[q0:q1],
            key[k0:k1],
            value[k0:k1],
            causal,
            scale,
            window_left,
            softcap,
            None,
            sinks,
        ).to(query.dtype)
    return out


def _check_cu_seqlens(cu: list[int], total: int, name: str) -> None:
    ok = (
        len(cu) > 0
        and cu[0] == 0
        and cu[-1] == total
        and all(a <= b for a, b in itertools.pairwise(cu))
    )
    if not ok:
        raise RuntimeError(
            f"topg::attention: argument '{name}' expected non-decreasing offsets from 0 to "
            f"{total} (the token count), got {cu}"
        )


def _check_max_seqlen(cu: list[int], given: int | None, name: str) -> None:
    longest = max((b - a for a, b in itertools.pairwise(cu)), default=0)
    if given is not None and given < longest:
        raise RuntimeError(
            f"topg::attention: argument '{name}' expected at least the longest sequence "
            f"({longest}), got {given}"
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
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    max_blocks = block_tables.shape[1]
    lens = seq_lens.tolist()
    if cu_seqlens_q is None:  # one query token per sequence
        cu = list(range(len(lens) + 1))
    else:
        cu = cu_seqlens_q.tolist()
        _check_paged_cu_seqlens(cu, len(lens), query.shape[0])
    out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
    for s, n in enumerate(lens):
        if n < 0 or n > max_blocks * block_size:
            raise RuntimeError(
                f"topg::paged_attention: argument 'seq_lens' expected values in "
                f"[0, {max_blocks * block_size}] (max_blocks_per_seq * block_size), got {n}"
            )
        q0, q1 = cu[s], cu[s + 1]
        if cu_seqlens_q is not None and q1 - q0 > n:  # (plain: seq_len 0 gives zeros)
            raise RuntimeError(
                f"topg::paged_attention: argument 'cu_seqlens_q' expected at most seq_lens[{s}]"
                f" = {n} query tokens for sequence {s} (its last tokens), got {q1 - q0}"
            )
        if n == 0:
            continue
        blocks = block_tables[s, : -(-n // block_size)].long()
        if bool(((blocks < 0) | (blocks >= num_blocks)).any()):
            raise RuntimeError(
                f"topg::paged_attention: argument 'block_tables' expected block ids in "
                f"[0, {num_blocks}), got {blocks.tolist()} for sequence {s}"
            )
        if q1 == q0:
            continue
        k = key_cache[blocks].flatten(0, 1)[:n]  # [n, Hkv, D]
        v = value_cache[blocks].flatten(0, 1)[:n]
        if key_scale is not None:  # int8 cache: fp32 values
            k = dequantize_kv(k, key_scale[blocks].flatten(0, 1)[:n])
            v = dequantize_kv(v, value_scale[blocks].flatten(0, 1)[:n])
        # The queries are the last q1 - q0 tokens: query i sees keys 0 .. n - (q1 - q0) + i
        # (bottom-right aligned causal).
        out[q0:q1] = _attend_one(
            query[q0:q1], k, v, True, scale, window_left, softcap, None, sinks
        ).to(query.dtype)
    return out


def _check_paged_cu_seqlens(cu: list[int], num_seqs: int, total: int) -> None:
    if len(cu) != num_seqs + 1:
        raise RuntimeError(
            f"topg::paged_attention: argument 'cu_seqlens_q' expected {num_seqs + 1} offsets "
            f"(num_seqs + 1, from 'seq_lens'), got {len(cu)}"
        )
    ok = (
        len(cu) > 0
        and cu[0] == 0
        and cu[-1] == total
        and all(a <= b for a, b in itertools.pairwise(cu))
    )
    if not ok:
        raise RuntimeError(
            f"topg::paged_attention: argument 'cu_seqlens_q' expected non-decreasing offsets "
            f"from 0 to {total} (the query rows), got {cu}"
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
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    slots = slot_mapping.long()
    if bool((slots >= num_slots).any()):
        raise RuntimeError(
            f"topg::reshape_and_cache: argument 'slot_mapping' expected slots below "
            f"{num_slots} (num_blocks * block_size), got max {int(slots.max())}"
        )
    keep = slots >= 0  # negative slot = padding token, skipped
    idx = slots[keep]
    for x, cache, scale in ((key, key_cache, key_scale), (value, value_cache, value_scale)):
        x = x[keep]
        if scale is not None:  # int8 cache
            x, s = quantize_kv(x)
            scale.view(num_slots, *scale.shape[2:]).index_copy_(0, idx, s)
        cache.view(num_slots, *cache.shape[2:]).index_copy_(0, idx, x)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 KV cache's quantisation: per row of ``D`` values (one token, one kv head).

    ``x [..., D]`` (any float dtype) -> ``(q int8 [..., D], scale float32 [...])`` with, in
    fp32, ``scale = max|x| / 127`` and ``q = round_half_even(x / scale)`` clamped to
    ``[-127, 127]`` (a NaN quotient stores 0: an all-zero row stores 0 with scale 0).
    A row holding NaN or inf gets a NaN or inf scale, so it dequantises to NaN.
    """
    xf = x.float()
    scale = xf.abs().amax(-1) / 127
    r = xf / scale[..., None]
    q = torch.where(torch.isnan(r), 0.0, r.clamp(-127, 127).round())
    return q.to(torch.int8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``q int8 [..., D]``, ``scale float32 [...]`` -> float32 ``q * scale``."""
    return q.float() * scale[..., None]
