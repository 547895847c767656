"""Reference semantics of ``embedding_q``: gather packed rows, de-quantise them."""

from __future__ import annotations

import torch

from torch_topg.formats import dequantize


def embedding_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    embedding_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    rows = weight.shape[0]
    ids = input.reshape(-1).long()
    if ids.numel() and bool(((ids < 0) | (ids >= rows)).any()):
        raise RuntimeError(
            f"topg::embedding_q: argument 'input' holds an id outside [0, {rows}) "
            "(the rows of 'weight')"
        )
    out = dequantize(weight.index_select(0, ids), format, embedding_dim)
    return out.to(dtype).reshape(*input.shape, embedding_dim)
