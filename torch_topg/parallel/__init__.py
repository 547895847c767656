"""Tensor parallelism on torch.distributed (gloo on CPU, NCCL on CUDA).

    torchrun --nproc-per-node 2 script.py

    import torch_topg.parallel as tp
    tp.init_distributed()
    model = tp.tensor_parallel(model)                  # even split (whole heads)
    model = tp.tensor_parallel(model, split_ratios=[0.6, 0.4])
    model = tp.tensor_parallel(tp.empty_model(config), checkpoint="model.safetensors")

Modules: ``sharding`` (split math), ``layers`` (parallel linear / embedding / LM head),
``plans`` (per family), ``loading`` (where shards come from), ``api``. See
``docs/parallel.md``.
"""

from torch_topg.parallel.api import failure_guard, init_distributed, tensor_parallel
from torch_topg.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    reduce_output,
)
from torch_topg.parallel.loading import empty_model
from torch_topg.parallel.plans import PLANS, Layout, Plan
from torch_topg.parallel.sharding import HeadSplit, split_heads, split_size, split_units

__all__ = [
    "PLANS",
    "ColumnParallelLinear",
    "HeadSplit",
    "Layout",
    "ParallelLMHead",
    "Plan",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "empty_model",
    "failure_guard",
    "init_distributed",
    "reduce_output",
    "split_heads",
    "split_size",
    "split_units",
    "tensor_parallel",
]
