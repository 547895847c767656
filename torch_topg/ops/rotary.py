"""Rotary position embedding: ``rotary_embedding`` (vLLM's signature, in place)."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.ops._checks import Arg, check_op
from torch_topg.ops._library import eager_entry, register

_OP = "rotary_embedding"

_rotary_embedding = eager_entry("rotary_embedding")


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """Rotates ``query`` and ``key`` in place by their tokens' positions.

    Args:
        positions: int64/int32, any shape ``[*tokens]`` (e.g. ``[T]`` or ``[B, S]``),
            values in ``[0, max_position)``.
        query: ``[*tokens, Hq * head_size]`` or ``[*tokens, Hq, head_size]``; only the
            last dim needs stride 1 (a slice of a fused qkv output works). float32 /
            bfloat16 / float16.
        key: like ``query`` with its own head count, or ``None``.
        head_size: size of one head.
        cos_sin_cache: ``[max_position, rot_dim]``: ``cos`` in the first ``rot_dim/2``
            columns, ``sin`` in the rest; the dtype of ``query`` or float32. ``rot_dim <
            head_size`` is partial rotary: the remaining elements stay untouched.
        is_neox: True rotates pairs ``(i, i + rot_dim/2)`` (GPT-NeoX / Llama
            ``rotate_half``); False rotates pairs ``(2i, 2i+1)`` (GPT-J).
    """
    if torch.compiler.is_compiling():
        torch.ops.topg.rotary_embedding.default(
            positions, query, key, head_size, cos_sin_cache, is_neox
        )
    else:
        _rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def _check_heads(name: str, t: torch.Tensor, positions: torch.Tensor, head_size: int) -> None:
    a = Arg(_OP, name, t).floating().last_dim_contiguous()
    nd = positions.dim()
    if t.dim() not in (nd + 1, nd + 2):
        a.fail(f"{nd + 1} or {nd + 2} dimensions (the token dims of 'positions', then heads)")
    for d in range(positions.dim()):
        a.size(d, positions.shape[d], "the token dims of 'positions'")
    if t.dim() == positions.dim() + 2:
        a.size(-1, head_size, "head_size")
    elif t.shape[-1] % head_size != 0:
        a.fail(f"a last dimension that is a multiple of head_size {head_size}")
    width = t.shape[-1] if t.dim() == positions.dim() + 1 else t.shape[-1] * t.shape[-2]
    try:  # explicit sizes: with no tokens, -1 would be ambiguous
        t.view(positions.numel(), width // head_size, head_size)
    except (RuntimeError, ValueError):  # FakeTensor raises ValueError
        a.fail("token dims that can be viewed as one (it is updated in place)")


def _check(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    Arg(_OP, "positions", positions).index()
    check_op(head_size > 0, _OP, f"argument 'head_size' expected a positive value, got {head_size}")
    _check_heads("query", query, positions, head_size)
    Arg(_OP, "query", query).same_device(positions, "positions")
    if key is not None:
        Arg(_OP, "key", key).same_dtype(query, "query").same_device(query, "query")
        _check_heads("key", key, positions, head_size)
    cache = Arg(_OP, "cos_sin_cache", cos_sin_cache).dim(2).floating().contiguous()
    cache.same_device(query, "query")
    rot_dim = cos_sin_cache.shape[1]
    if not (rot_dim % 2 == 0 and 2 <= rot_dim <= head_size):
        cache.fail(f"an even rotary dimension (size at dim 1) in [2, head_size={head_size}]")


register(
    _OP,
    check=_check,
    fake=lambda *args: None,
    reference=reference.rotary_embedding,
    wrapper=rotary_embedding,
)
