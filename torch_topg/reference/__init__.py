"""Pure-PyTorch semantics of every ``topg`` op.

These functions are the test oracle, the benchmark baseline and the fallback on any
device without a native kernel. They know nothing of the rest of the package.
"""

from torch_topg.reference.attention import attention, paged_attention, reshape_and_cache
from torch_topg.reference.norm import fused_add_rms_norm, rms_norm

__all__ = [
    "attention",
    "fused_add_rms_norm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
]
