"""The topg ops on torch tensors through the Pallas kernels.

Each function takes a backend (``_bridge``) and the op's arguments (already checked by
the op's check function), does the layout work in torch (on XLA tensors that is XLA
code around the custom call), runs the kernel's single ``pallas_call`` and returns what
the op returns. ``unsupported(op, ...)`` names the arguments a kernel does not cover
(the XLA kernel then runs the reference for that call).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_topg.tpu.kernels import kernels

# Mosaic has no fp16 vector arithmetic and TPUs no fp16 units; fp16 takes the reference.
_DTYPES = (torch.float32, torch.bfloat16)


def unsupported(op: str, *args: Any, **kwargs: Any) -> str:
    """Why this call cannot use the Pallas kernel, or '' if it can."""
    first = args[0]
    if first.dtype not in _DTYPES:
        return f"dtype {first.dtype} (the Pallas kernels take float32 and bfloat16)"
    if op == "attention":
        if kwargs.get("cu_seqlens_q") is not None or kwargs.get("cu_seqlens_k") is not None:
            return "ragged batches (cu_seqlens): the Pallas kernel takes dense batches"
        if kwargs.get("mask") is not None:
            return "an explicit mask: the Pallas kernel takes causal / window masks only"
    if op == "paged_attention" and kwargs.get("cu_seqlens_q") is not None:
        return "several query tokens per sequence (cu_seqlens_q): the Pallas kernel takes one"
    if op == "paged_attention" and kwargs.get("key_scale") is not None:
        return "an int8 KV cache (key_scale): the Pallas kernel reads float caches"
    return ""


def rms_norm(be: Any, input: torch.Tensor, weight: torch.Tensor, epsilon: float) -> torch.Tensor:
    k = kernels("norm")
    h = input.shape[-1]
    x = input.reshape(-1, h)
    if x.shape[0] == 0:
        return torch.empty_like(input)
    (out,) = be.call(
        k.rms_norm_kernel, [x, weight.reshape(1, h)], [(x.shape, input.dtype)],
        epsilon=float(epsilon), block_rows=k.BLOCK_ROWS,
    )  # fmt: skip
    return out.reshape(input.shape)


def fused_add_rms_norm(
    be: Any, input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, epsilon: float
) -> None:
    k = kernels("norm")
    h = input.shape[-1]
    x, r = input.reshape(-1, h), residual.reshape(-1, h)
    if x.shape[0] == 0:
        return
    out, res = be.call(
        k.fused_add_rms_norm_kernel, [x, r, weight.reshape(1, h)],
        [(x.shape, input.dtype), (r.shape, residual.dtype)],
        epsilon=float(epsilon), block_rows=k.BLOCK_ROWS,
    )  # fmt: skip
    residual.copy_(res.reshape(residual.shape))
    input.copy_(out.reshape(input.shape))


def attention(
    be: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    window_left: int = -1,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    **unused: Any,
) -> torch.Tensor:
    k = kernels("attention")
    if query.shape[1] == 0 or key.shape[1] == 0:
        return torch.zeros_like(query, memory_format=torch.contiguous_format)
    # [B, S, H, D] -> the kernel's [B, H, S, D]
    q, kk, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    tensors = [q, kk, v] if sinks is None else [q, kk, v, sinks]
    (out,) = be.call(
        k.attention_kernel, tensors, [(q.shape, query.dtype)],
        causal=bool(causal), scale=None if scale is None else float(scale),
        window_left=int(window_left), softcap=float(softcap),
        block_q=k.BLOCK_Q, block_k=k.BLOCK_K,
    )  # fmt: skip
    return out.transpose(1, 2).contiguous()


def paged_attention(
    be: Any,
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
    assert cu_seqlens_q is None, "unsupported() sends ragged calls to the reference"
    assert key_scale is None, "unsupported() sends int8 caches to the reference"
    k = kernels("paged_attention")
    if query.shape[0] == 0:
        return torch.empty_like(query)
    pps = k.resolve_pages_per_step(None, key_cache.shape[1], block_tables.shape[1])
    tensors = [
        block_tables.to(torch.int32).contiguous(),
        seq_lens.to(torch.int32).contiguous(),
        query.contiguous(),
        *([] if sinks is None else [sinks]),
        *([key_cache] * pps),  # one operand per page of a step (no copy)
        *([value_cache] * pps),
    ]
    (out,) = be.call(
        k.paged_attention_call, tensors, [(query.shape, query.dtype)],
        scale=None if scale is None else float(scale),
        window_left=int(window_left), softcap=float(softcap), with_sinks=sinks is not None,
    )  # fmt: skip
    return out


def moe_topk(
    be: Any,
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = False,
    correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    k = kernels("moe")
    t, e = router_logits.shape
    if t == 0:
        return (
            router_logits.new_empty((0, top_k), dtype=torch.float32),
            router_logits.new_empty((0, top_k), dtype=torch.int32),
        )
    bias = [] if correction_bias is None else [correction_bias.reshape(1, e)]
    weights, ids = be.call(
        k.moe_topk_kernel, [router_logits.contiguous(), *bias],
        [((t, top_k), torch.float32), ((t, top_k), torch.int32)],
        top_k=int(top_k), scoring=scoring, block_tokens=k.BLOCK_TOKENS,
    )  # fmt: skip
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, ids


def gmm_metadata(sizes: torch.Tensor, rows: int, bm: int) -> list[torch.Tensor]:
    """torch twin of ``moe.gmm_metadata`` plus the group starts / ends: [group_ids,
    tile_ids, num_visits, starts, ends], int32, with static shapes (XLA-friendly)."""
    groups = sizes.shape[0]
    size = -(-rows // bm) + groups - 1
    sizes = sizes.long()
    ends = torch.cumsum(sizes, 0)
    starts = ends - sizes
    first = torch.div(starts, bm, rounding_mode="floor")
    last = torch.div(ends - 1, bm, rounding_mode="floor")
    count = torch.where(sizes > 0, last - first + 1, torch.zeros_like(sizes))
    visit_end = torch.cumsum(count, 0)
    total = visit_end[-1:]
    v = torch.minimum(torch.arange(size, device=sizes.device), (total - 1).clamp_min(0))
    group = torch.searchsorted(visit_end, v, right=True).clamp_max(groups - 1)
    tile = first[group] + v - (visit_end[group] - count[group])
    return [x.to(torch.int32) for x in (group, tile, total, starts, ends)]


def fused_moe(
    be: Any,
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    k = kernels("moe")
    t, h = hidden_states.shape
    top_k = topk_ids.shape[1]
    e, inter = w_gate_up.shape[0], w_down.shape[2]
    if t == 0 or top_k == 0:
        return torch.zeros_like(hidden_states)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)  # pairs sorted by expert
    sizes = torch.zeros(e, dtype=torch.long, device=flat.device)
    sizes.scatter_add_(0, flat, torch.ones_like(flat))
    x = hidden_states[order // top_k].contiguous()  # [M, H], M = T * k
    m = x.shape[0]

    def gmm(lhs: torch.Tensor, w: torch.Tensor, act: str | None, n: int) -> torch.Tensor:
        bm, bn, bk = k.gmm_tiles(m, w.shape[1], lhs.shape[1], act, k.BLOCK_M, k.BLOCK_N, k.BLOCK_K)
        weights = [w, w] if act is not None else [w]
        (out,) = be.call(
            k.gmm_call, [*gmm_metadata(sizes, m, bm), lhs, *weights],
            [((m, n), torch.float32)], activation=act, bm=bm, bn=bn, bk=bk,
        )  # fmt: skip
        return out

    hidden = gmm(x, w_gate_up, activation, inter)  # act(gate) * up, [M, I] fp32
    y = gmm(hidden, w_down, None, h)  # [M, H] fp32
    pairs = torch.empty_like(y)
    pairs[order] = y
    out = (pairs.view(t, top_k, h) * topk_weights.float().unsqueeze(-1)).sum(1)
    return out.to(hidden_states.dtype)
