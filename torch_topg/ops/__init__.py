"""Typed wrappers of the ``topg`` ops (``torch.ops.topg.*``); importing registers them."""

from torch_topg.ops.fused_moe import fused_moe
from torch_topg.ops.linear import linear
from torch_topg.ops.norm import fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "fused_moe", "linear", "rms_norm"]
