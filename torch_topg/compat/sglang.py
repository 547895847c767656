"""sgl-kernel-compatible entry points (``from sgl_kernel import ...``) backed by topg.

Same names, argument order and in-place semantics as sgl-kernel's Python functions for
the ops topg has. sgl-kernel returns its outputs (allocating ``out`` when it is None)
where vLLM writes a caller-given ``out``; the functions here follow sgl-kernel. Extra
keyword arguments that only tune CUDA launches (``enable_pdl``) are accepted and
ignored. See ``docs/integrations.md``.
"""

from __future__ import annotations

import torch

from torch_topg import ops as topg

__all__ = [
    "apply_rope_with_cos_sin_cache_inplace",
    "fused_add_rmsnorm",
    "gelu_and_mul",
    "gelu_tanh_and_mul",
    "gemma_fused_add_rmsnorm",
    "gemma_rmsnorm",
    "rmsnorm",
    "silu_and_mul",
    "topk_softmax",
]


def _into(out: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    if out is None:
        return value
    out.copy_(value)
    return out


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``input / rms(input) * weight`` over the last dim; into ``out`` if given."""
    return _into(out, topg.rms_norm(input, weight, eps))


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``; ``input = rmsnorm(residual) * weight``."""
    topg.fused_add_rms_norm(input, residual, weight, eps)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Gemma's RMSNorm scales by ``1 + weight``."""
    return _into(out, topg.rms_norm(input, weight.float() + 1.0, eps))


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    topg.fused_add_rms_norm(input, residual, weight.float() + 1.0, eps)


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(input[..., :d]) * input[..., d:]``; into ``out`` if given."""
    return _into(out, topg.silu_and_mul(input))


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _into(out, topg.gelu_and_mul(input, "none"))


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    return _into(out, topg.gelu_and_mul(input, "tanh"))


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """In place on ``query [T, Hq * D]`` / ``key [T, Hkv * D]``; ``cos_sin_cache
    [max_pos, rot_dim]`` (cos then sin halves)."""
    topg.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def topk_softmax(
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    gating_output: torch.Tensor,
    renormalize: bool = False,
) -> None:
    """In place: softmax top-k of ``gating_output [T, E]`` into ``topk_weights [T, k]``
    (fp32) and ``topk_ids [T, k]`` (int32)."""
    w, ids = topg.moe_topk(gating_output, topk_weights.shape[1], renormalize=renormalize)
    topk_weights.copy_(w)
    topk_ids.copy_(ids)
