"""Typed wrappers of the ``topg`` ops (``torch.ops.topg.*``); importing registers them.

``OPS`` is the op registry (name -> :class:`OpSpec`: schema, check, fake, reference,
fallback, wrapper, kernels per device). ``dispatch`` chooses what runs
``attention``, ``paged_attention``, ``fused_moe`` and ``linear`` on CUDA tensors.
"""

from torch_topg.ops import dispatch
from torch_topg.ops._registry import OPS, OpSpec
from torch_topg.ops.activation import gelu_and_mul, silu_and_mul
from torch_topg.ops.attention import attention, paged_attention, reshape_and_cache
from torch_topg.ops.collectives import all_reduce, fused_all_reduce_add_rms_norm
from torch_topg.ops.embedding_q import embedding_q
from torch_topg.ops.fused_moe import fused_moe
from torch_topg.ops.fused_moe_q import fused_moe_q
from torch_topg.ops.linear import linear
from torch_topg.ops.linear_q import linear_q
from torch_topg.ops.moe_topk import moe_topk
from torch_topg.ops.norm import fused_add_rms_norm, rms_norm
from torch_topg.ops.rotary import rotary_embedding

__all__ = [
    "OPS",
    "OpSpec",
    "all_reduce",
    "attention",
    "dispatch",
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
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
