"""Reference semantics of the collective ops: ``torch.distributed`` + the reference norm."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from torch_topg.reference.norm import fused_add_rms_norm


def all_reduce(input: torch.Tensor, group_name: str) -> torch.Tensor:
    out = input.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=c10d._resolve_process_group(group_name))
    return out


def fused_all_reduce_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_name: str,
) -> None:
    reduced = all_reduce(input, group_name)
    fused_add_rms_norm(reduced, residual, weight, epsilon)
    input.copy_(reduced)
