"""Typed wrappers of the ``topg`` ops (``torch.ops.topg.*``); importing registers them."""

from torch_topg.ops.attention import attention, paged_attention, reshape_and_cache
from torch_topg.ops.norm import fused_add_rms_norm, rms_norm

__all__ = [
    "attention",
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
]
