"""Reference semantics of ``rotary_embedding`` (vLLM's layout and in-place contract)."""

from __future__ import annotations

import torch


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rot_dim] fp32; cos/sin: [T, 1, rot_dim // 2]
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    rot_dim, max_pos = cos_sin_cache.shape[1], cos_sin_cache.shape[0]
    if positions.numel() and (positions.min() < 0 or positions.max() >= max_pos):
        # A value check: the fake kernel cannot see values, the native kernel and this
        # reference both refuse (a negative index would otherwise wrap around silently).
        raise RuntimeError(
            f"topg::rotary_embedding: argument 'positions' (shape {list(positions.shape)}, "
            f"dtype {str(positions.dtype).removeprefix('torch.')}, device {positions.device}) "
            f"expected values in [0, {max_pos}) (rows of 'cos_sin_cache'), got "
            f"[{int(positions.min())}, {int(positions.max())}]"
        )
    cos, sin = cos_sin_cache[positions.reshape(-1).long()].float().chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for t in (query, key):
        if t is None:
            continue
        view = t.view(
            positions.numel(), t.numel() // max(1, positions.numel() * head_size), head_size
        )
        rot = view[..., :rot_dim]
        rot.copy_(_rotate(rot.float(), cos, sin, is_neox))
