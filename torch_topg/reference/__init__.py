"""Pure-PyTorch semantics of every ``topg`` op.

These functions are the test oracle, the benchmark baseline and the fallback on any
device without a native kernel. They know nothing of the rest of the package.
"""

from torch_topg.reference.linear import linear
from torch_topg.reference.moe import fused_moe
from torch_topg.reference.norm import fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "fused_moe", "linear", "rms_norm"]
