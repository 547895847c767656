"""Pure-PyTorch semantics of every ``topg`` op.

These functions are the test oracle, the benchmark baseline and the fallback on any
device without a native kernel. They know nothing of the rest of the package.
"""

from torch_topg.reference.activation import gelu_and_mul, silu_and_mul
from torch_topg.reference.attention import (
    attention,
    dequantize_kv,
    paged_attention,
    quantize_kv,
    reshape_and_cache,
)
from torch_topg.reference.collectives import all_reduce, fused_all_reduce_add_rms_norm
from torch_topg.reference.embedding_q import embedding_q
from torch_topg.reference.fused_moe import fused_moe
from torch_topg.reference.fused_moe_q import fused_moe_q
from torch_topg.reference.linear import linear
from torch_topg.reference.linear_q import linear_q
from torch_topg.reference.moe_topk import moe_topk
from torch_topg.reference.norm import fused_add_rms_norm, rms_norm
from torch_topg.reference.rotary import rotary_embedding

__all__ = [
    "all_reduce",
    "attention",
    "dequantize_kv",
    "embedding_q",
    "fused_add_rms_norm",
    "fused_all_reduce_add_rms_norm",
    "fused_moe",
    "fused_moe_q",
    "gelu_and_mul",
    "linear",
    "linear_q",
    "moe_topk",
    "paged_attention",
    "quantize_kv",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
