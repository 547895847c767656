"""vLLM-compatible entry points: same names, argument order, dtypes and in-place semantics
as vLLM's custom ops (``vllm._custom_ops``) and its fused-MoE functions, backed by topg
kernels. A fork switches ``from vllm import _custom_ops as ops`` to
``from torch_topg.compat import vllm as ops`` for the ops listed here.

Versions: where a name still exists in the current vLLM release (0.33.0) the function
follows that release's signature (``topk_softmax`` with ``e_score_correction_bias`` and
``is_padding``; ``fused_experts`` without the positional ``inplace``; ``rotary_embedding``
with ``rope_dim_offset`` / ``inverse``; ``reshape_and_cache`` with ``interleaved_v``).
Names vLLM has since removed from its Python API keep the signature of the last
releases that had them, for forks that still call them: ``silu_and_mul`` /
``gelu_and_mul`` / ``gelu_tanh_and_mul`` (last checked in 0.6.6), ``paged_attention_v1/v2``
(0.24.0), ``fused_moe`` (0.10.2).
``docs/integrations.md`` lists, per function, the vLLM versions whose signature it
matches (checked against each release's source). A vLLM deployment that runs vLLM's own
layers needs none of this: the plugin :mod:`torch_topg.integrations.vllm_plugin` swaps
topg kernels into them.

Layouts: vLLM's ``paged_attention_v1/v2`` and ``reshape_and_cache`` use the *paged*
cache layout (keys ``[num_blocks, num_kv_heads, head_size / x, block_size, x]`` with
``x = 16 // element_size``, values ``[num_blocks, num_kv_heads, head_size, block_size]``);
topg's kernels use the *flash* layout ``[num_blocks, block_size, num_kv_heads, head_size]``
(vLLM's ``reshape_and_cache_flash``). These functions accept vLLM's layout and are
correct with it: ``reshape_and_cache`` scatters with indexing, and ``paged_attention_*``
gathers the blocks a batch references into topg's layout first (one copy of those
blocks per call). A fork that can choose its cache layout should use the flash layout
(``reshape_and_cache_flash`` here, or ``torch_topg.ops.paged_attention``) and skip that
copy.

Not supported (raise ``NotImplementedError``): quantised KV caches (``kv_cache_dtype``
other than ``"auto"``), ALiBi, block-sparse attention, quantised or expert-parallel MoE,
grouped top-k routing, ``rope_dim_offset != 0``, ``interleaved_v=True``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torch_topg import ops as topg

__all__ = [
    "fused_add_rms_norm",
    "fused_experts",
    "fused_moe",
    "fused_topk",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "paged_attention_v1",
    "paged_attention_v2",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "topk_softmax",
]


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"torch_topg.compat.vllm: {what} is not supported")


def _check_kv_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype != "auto":
        raise _unsupported(f"kv_cache_dtype={kv_cache_dtype!r} (only 'auto')")


# --- norms, positions, activations -------------------------------------------------------


def _norm_weight(input: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """vLLM passes ``weight=None`` for a norm without a learned scale."""
    if weight is None:
        return torch.ones(input.shape[-1], dtype=input.dtype, device=input.device)
    return weight


def rms_norm(
    out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor | None, epsilon: float
) -> None:
    """``out = input / rms(input) * weight`` over the last dim (``out`` written in place);
    ``weight=None``: no scale."""
    out.copy_(topg.rms_norm(input, _norm_weight(input, weight), epsilon))


def fused_add_rms_norm(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float
) -> None:
    """In place: ``residual += input``; ``input = rms_norm(residual) * weight``."""
    topg.fused_add_rms_norm(input, residual, _norm_weight(input, weight), epsilon)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    rope_dim_offset: int = 0,
    inverse: bool = False,
) -> None:
    """In place on ``query`` / ``key`` (``[T, H * head_size]``); ``inverse=True`` rotates
    by ``-position`` (undoes the rotation)."""
    if rope_dim_offset != 0:
        raise _unsupported(f"rope_dim_offset={rope_dim_offset}")
    if inverse:
        cos, sin = cos_sin_cache.chunk(2, dim=-1)
        cos_sin_cache = torch.cat([cos, -sin], dim=-1)
    topg.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


# silu_and_mul / gelu_and_mul / gelu_tanh_and_mul: vLLM's Python wrappers up to 0.6.6
# (later releases call torch.ops._C directly); the signature of those releases.


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = silu(x[..., :d]) * x[..., d:]``."""
    out.copy_(topg.silu_and_mul(x))


def gelu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = gelu(x[..., :d]) * x[..., d:]`` (exact erf GELU)."""
    out.copy_(topg.gelu_and_mul(x, "none"))


def gelu_tanh_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """``out = gelu_tanh(x[..., :d]) * x[..., d:]``."""
    out.copy_(topg.gelu_and_mul(x, "tanh"))


# --- KV cache and paged attention ------------------------------------------------------


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    interleaved_v: bool = False,
) -> None:
    """Write ``key`` / ``value`` ``[T, Hkv, D]`` into vLLM's paged layout, in place.

    ``key_cache [num_blocks, Hkv, D / x, block_size, x]``, ``value_cache [num_blocks, Hkv,
    D, block_size]``; token ``t`` goes to block ``slot // block_size``, offset
    ``slot % block_size``; a negative slot is skipped (padding).
    """
    _check_kv_dtype(kv_cache_dtype)
    if interleaved_v:
        raise _unsupported("interleaved_v=True")
    num_blocks, hkv, d_x, block_size, x = key_cache.shape
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel() and int(slots.max()) >= num_blocks * block_size:
        raise ValueError(
            f"reshape_and_cache: slot {int(slots.max())} out of range for "
            f"{num_blocks} blocks of {block_size}"
        )
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices on dims 0 and 3 (not adjacent): the indexed view is [T, Hkv, D/x, x].
    key_cache[blocks, :, :, offsets, :] = key.reshape(-1, hkv, d_x, x).to(key_cache.dtype)
    value_cache[blocks, :, :, offsets] = value.to(value_cache.dtype)


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Flash layout ``[num_blocks, block_size, Hkv, D]``: topg's own kernel, in place."""
    _check_kv_dtype(kv_cache_dtype)
    topg.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def _paged_to_flash(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the blocks the batch uses into topg's layout; renumber the block table."""
    num_blocks, hkv, d_x, block_size, x = key_cache.shape
    used = (seq_lens.to(torch.long) + block_size - 1) // block_size  # blocks per sequence
    cols = torch.arange(block_tables.shape[1], device=block_tables.device)
    valid = cols[None, :] < used[:, None]
    ids = block_tables.to(torch.long)[valid]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"paged_attention: block id out of range [0, {num_blocks})")
    uniq, inverse = torch.unique(ids, return_inverse=True)
    k = key_cache[uniq].permute(0, 3, 1, 2, 4).reshape(-1, block_size, hkv, d_x * x)
    v = value_cache[uniq].permute(0, 3, 1, 2)
    tables = torch.zeros_like(block_tables, dtype=torch.int32)
    tables[valid] = inverse.to(torch.int32)
    return k.contiguous(), v.contiguous(), tables


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """Decode attention over vLLM's paged cache; ``out [num_seqs, Hq, D]`` in place.

    ``query [num_seqs, Hq, D]``; ``block_tables`` int32 ``[num_seqs, max_blocks]``;
    ``seq_lens`` int32 ``[num_seqs]`` (including the current token, already cached).
    """
    _check_kv_dtype(kv_cache_dtype)
    if alibi_slopes is not None:
        raise _unsupported("alibi_slopes")
    if blocksparse_vert_stride > 1:
        raise _unsupported("block-sparse attention")
    if key_cache.shape[1] != num_kv_heads or key_cache.shape[3] != block_size:
        raise ValueError(
            f"paged_attention: key_cache {tuple(key_cache.shape)} does not match "
            f"num_kv_heads={num_kv_heads}, block_size={block_size}"
        )
    k, v, tables = _paged_to_flash(key_cache, value_cache, block_tables, seq_lens)
    out.copy_(topg.paged_attention(query, k, v, tables, seq_lens.to(torch.int32), scale=scale))


def paged_attention_v2(
    out: torch.Tensor,
    exp_sum: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None,
    kv_cache_dtype: str,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """Same result as :func:`paged_attention_v1`. ``exp_sum`` / ``max_logits`` /
    ``tmp_out`` are vLLM's per-partition scratch buffers; topg's kernel splits long
    sequences itself, so they are accepted and left untouched."""
    paged_attention_v1(
        out,
        query,
        key_cache,
        value_cache,
        num_kv_heads,
        scale,
        block_tables,
        seq_lens,
        block_size,
        max_seq_len,
        alibi_slopes,
        kv_cache_dtype,
        k_scale,
        v_scale,
        tp_rank,
        blocksparse_local_blocks,
        blocksparse_vert_stride,
        blocksparse_block_size,
        blocksparse_head_sliding_step,
    )


# --- mixture of experts ------------------------------------------------------------------


def topk_softmax(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    token_expert_indices: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool = False,
    e_score_correction_bias: torch.Tensor | None = None,
    is_padding: torch.Tensor | None = None,
) -> None:
    """In place: softmax top-k of ``gating_output [T, E]``.

    ``topk_weights [T, k]`` fp32, ``topk_ids [T, k]`` int32 (or int64),
    ``token_expert_indices[t, j] = j * T + t``. ``e_score_correction_bias [E]`` is added to
    the scores for the choice only (weights stay the softmax scores); ``is_padding [T]``
    bool marks padding rows, whose ids are set to -1 (routed to no expert).
    """
    num_tokens, k = topk_weights.shape
    w, ids = topg.moe_topk(
        gating_output,
        k,
        scoring="softmax",
        renormalize=renormalize,
        correction_bias=e_score_correction_bias,
    )
    topk_weights.copy_(w)
    if is_padding is not None:
        ids = ids.masked_fill(is_padding.to(torch.bool).view(-1, 1), -1)
    topk_ids.copy_(ids)
    rows = torch.arange(k * num_tokens, device=gating_output.device, dtype=torch.int32)
    token_expert_indices.copy_(rows.view(k, num_tokens).t())


def fused_topk(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    indices_type: torch.dtype | None = None,
    scoring_func: str = "softmax",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``fused_topk``: ``(topk_weights fp32, topk_ids, token_expert_indices)``;
    ``topk_ids`` int32 unless ``indices_type``; ``scoring_func`` softmax or sigmoid."""
    t = gating_output.shape[0]
    w, ids = topg.moe_topk(gating_output, topk, scoring=scoring_func, renormalize=renormalize)
    rows = torch.arange(topk * t, device=gating_output.device, dtype=torch.int32)
    return w, ids.to(indices_type or torch.int32), rows.view(topk, t).t().contiguous()


_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


def _activation_name(activation: object) -> str:
    if isinstance(activation, bool):  # fused_experts(..., topk_ids, True): vLLM <= 0.23
        raise TypeError(
            "torch_topg.compat.vllm.fused_experts: argument 6 is 'activation' (vLLM >= 0.24 "
            f"has no positional 'inplace'), got {activation!r}; pass inplace=... by keyword"
        )
    name = getattr(activation, "value", activation)  # vLLM's MoEActivation enum or a str
    if name not in _ACTIVATIONS:
        raise _unsupported(f"activation={name!r}")
    return _ACTIVATIONS[str(name)]


def fused_experts(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: object = "silu",
    apply_router_weight_on_input: bool = False,
    global_num_experts: int = -1,
    expert_map: torch.Tensor | None = None,
    quant_config: object | None = None,
    *,
    inplace: bool = False,
    **quant_kwargs: object,
) -> torch.Tensor:
    """MoE MLP: ``w1 [E, 2I, H]`` (gate rows first, then up: vLLM's ``w13``), ``w2 [E, H, I]``.

    vLLM 0.33's signature; ``activation`` is a string or vLLM's ``MoEActivation``. A
    negative id in ``topk_ids`` (a padding row, see :func:`topk_softmax`) contributes
    nothing. ``inplace=True`` (keyword only; positional in vLLM <= 0.23) writes the result
    into ``hidden_states`` and returns it; old quantisation keywords (``use_fp8_w8a8``,
    ...) are accepted when false.
    """
    act = _activation_name(activation)
    if apply_router_weight_on_input:
        raise _unsupported("apply_router_weight_on_input=True")
    if expert_map is not None:
        raise _unsupported("expert_map (expert parallelism)")
    for attr in ("quant_dtype", "weight_quant_dtype", "w1_bias", "w2_bias"):
        if getattr(quant_config, attr, None) is not None:
            raise _unsupported(f"quant_config with {attr} (quantised or biased experts)")
    if any(bool(v) for k, v in quant_kwargs.items() if k.startswith("use_")):
        raise _unsupported("quantised MoE weights")
    unrouted = topk_ids < 0
    ids = topk_ids.clamp(min=0)
    weights = topk_weights.masked_fill(unrouted, 0)
    out = topg.fused_moe(hidden_states, w1, w2, weights, ids, activation=act)
    if inplace:
        hidden_states.copy_(out)
        return hidden_states
    return out


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    gating_output: torch.Tensor,
    topk: int,
    renormalize: bool,
    inplace: bool = False,
    activation: str = "silu",
    use_grouped_topk: bool = False,
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    custom_routing_function: Callable | None = None,
    scoring_func: str = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    **kwargs: object,
) -> torch.Tensor:
    """Routing (softmax or sigmoid top-k) then :func:`fused_experts`: vLLM's ``fused_moe``
    function of the releases that had it (see ``docs/integrations.md``)."""
    if use_grouped_topk:
        raise _unsupported("use_grouped_topk=True")
    if custom_routing_function is not None:
        topk_weights, topk_ids = custom_routing_function(
            hidden_states, gating_output, topk, renormalize
        )
    else:
        topk_weights, topk_ids = topg.moe_topk(
            gating_output,
            topk,
            scoring=scoring_func,
            renormalize=renormalize,
            correction_bias=e_score_correction_bias,
        )
    return fused_experts(
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        inplace=inplace,
        activation=activation,
        **kwargs,
    )
