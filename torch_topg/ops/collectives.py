"""Collective ops on ``torch.distributed``: ``all_reduce`` and
``fused_all_reduce_add_rms_norm``.

Both take the process group by its c10d name (``pg.group_name``), a string, so the ops
have plain schemas that dynamo records in a graph like any other op (a ``ProcessGroup``
object is not a schema type). The name is resolved with torch's own resolver
(``torch.distributed.distributed_c10d._resolve_process_group``) when the op runs.

``all_reduce`` is functional (returns a new tensor, the sum over the group), so it is
traceable and the compile backend can pattern-match it. The fused op has the in-place
convention of ``fused_add_rms_norm`` and the semantics of vLLM's / FlashInfer's
all-reduce fusion (``residual_out = all_reduce(x) + residual``,
``norm_out = rms_norm(residual_out)``)::

    s = all_reduce(input) + residual
    residual <- s ; input <- rms_norm(s, weight, epsilon)

On CPU (gloo) and CUDA (NCCL) the "fusion" reduces ``input`` in place (no extra buffer,
no copy) and then runs the device's native ``fused_add_rms_norm``; a one-shot kernel that
reduces and normalises in one pass needs peer-to-peer memory (NVLink), see
``docs/parallel.md``. Other devices run the reference: the same ``torch.distributed``
calls and the reference add + norm.

Without an initialised ``torch.distributed`` both ops raise (naming ``group_name``):
silently returning the input would turn a mis-launched tensor-parallel model into
wrong numbers. A group of world size 1 is valid (the sum is the input).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_topg import reference
from torch_topg.ops._checks import Arg, check_op
from torch_topg.ops._library import LIB, eager_entry, register
from torch_topg.ops.norm import check_add_rms_norm
from torch_topg.utils.distributed import peer_failure

_all_reduce = eager_entry("all_reduce")
_fused_all_reduce_add_rms_norm = eager_entry("fused_all_reduce_add_rms_norm")


def group_name_of(group: dist.ProcessGroup | str | None) -> str:
    """The c10d name of ``group`` (``None``: the default group; a string is returned as is)."""
    if isinstance(group, str):
        return group
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "topg collectives: argument 'group' needs torch.distributed to be initialised "
            "(torch.distributed.init_process_group, e.g. under torchrun)"
        )
    pg = group if group is not None else dist.group.WORLD
    return pg.group_name


def resolve_group(op: str, group_name: str) -> dist.ProcessGroup:
    """The ``ProcessGroup`` named ``group_name``; a clear error when there is none."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"topg::{op}: argument 'group_name' ('{group_name}') names a process group, but "
            "torch.distributed is not initialised (call torch.distributed."
            "init_process_group first, or launch with torchrun)"
        )
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except Exception as e:
        raise RuntimeError(
            f"topg::{op}: argument 'group_name' ('{group_name}') is not a known process "
            "group (pass pg.group_name of a group of this process)"
        ) from e


def _reduce_(op: str, t: torch.Tensor, group_name: str) -> None:
    """Sums ``t`` (contiguous) over the group, in place; a peer's failure is reported."""
    pg = resolve_group(op, group_name)
    try:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=pg)
    except Exception as e:
        failure = peer_failure()
        why = f"another rank failed ({failure})" if failure else "a peer left or timed out"
        raise RuntimeError(
            f"topg::{op}: the all-reduce over group '{group_name}' failed: {why}. "
            f"This rank stops too. ({type(e).__name__}: {e})"
        ) from e


def all_reduce(input: torch.Tensor, group: dist.ProcessGroup | str | None = None) -> torch.Tensor:
    """Sum of ``input`` over the ranks of ``group`` (functional: ``input`` is unchanged).

    Args:
        input: any shape, float32 / bfloat16 / float16, the same shape on every rank.
        group: a ``ProcessGroup``, its ``group_name``, or None for the default group.

    Returns:
        A new contiguous tensor, the same on every rank.
    """
    name = group_name_of(group)
    if torch.compiler.is_compiling():
        return torch.ops.topg.all_reduce.default(input, name)
    return _all_reduce(input, name)


def fused_all_reduce_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float = 1e-6,
    group: dist.ProcessGroup | str | None = None,
) -> None:
    """In place: ``s = all_reduce(input) + residual``; ``residual = s``;
    ``input = rms_norm(s, weight)``.

    Args:
        input: ``[..., hidden]`` contiguous, this rank's partial sum (for example a
            row-parallel projection's output); overwritten with the normalised sum.
        residual: same shape and dtype as ``input``, contiguous, the same on every rank;
            overwritten with the reduced sum.
        weight: ``[hidden]``, the dtype of ``input`` or float32.
        group: a ``ProcessGroup``, its ``group_name``, or None for the default group.
    """
    name = group_name_of(group)
    if torch.compiler.is_compiling():
        torch.ops.topg.fused_all_reduce_add_rms_norm.default(input, residual, weight, epsilon, name)
    else:
        _fused_all_reduce_add_rms_norm(input, residual, weight, epsilon, name)


def _check_group_name(op: str, group_name: object) -> None:
    check_op(
        isinstance(group_name, str) and bool(group_name),
        op,
        f"argument 'group_name' expected a process group name (pg.group_name), got {group_name!r}",
    )


def _check_all_reduce(input: torch.Tensor, group_name: str) -> None:
    Arg("all_reduce", "input", input).floating()
    _check_group_name("all_reduce", group_name)


def _check_fused_all_reduce_add_rms_norm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_name: str,
) -> None:
    check_add_rms_norm("fused_all_reduce_add_rms_norm", input, residual, weight)
    _check_group_name("fused_all_reduce_add_rms_norm", group_name)


def _all_reduce_impl(input: torch.Tensor, group_name: str) -> torch.Tensor:
    _check_all_reduce(input, group_name)
    out = input.clone(memory_format=torch.contiguous_format)
    _reduce_("all_reduce", out, group_name)
    return out


def _fused_all_reduce_add_rms_norm_impl(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    epsilon: float,
    group_name: str,
) -> None:
    _check_fused_all_reduce_add_rms_norm(input, residual, weight, epsilon, group_name)
    # ``input`` is ours to overwrite (Tensor(a!)): reduce into it, no temporary
    _reduce_("fused_all_reduce_add_rms_norm", input, group_name)
    torch.ops.topg.fused_add_rms_norm.default(input, residual, weight, epsilon)


register(
    "all_reduce",
    check=_check_all_reduce,
    wrapper=all_reduce,
    fake=lambda input, group_name: torch.empty_like(input, memory_format=torch.contiguous_format),
    reference=reference.all_reduce,
)
register(
    "fused_all_reduce_add_rms_norm",
    check=_check_fused_all_reduce_add_rms_norm,
    wrapper=fused_all_reduce_add_rms_norm,
    fake=lambda input, residual, weight, epsilon, group_name: None,
    reference=reference.fused_all_reduce_add_rms_norm,
)
# The transport is c10d's (gloo on CPU, NCCL on CUDA), so these kernels are Python by
# nature, not a fallback: an in-place reduction plus the device's native add + norm.
for _key in ("CPU", "CUDA"):
    LIB.impl("all_reduce", _all_reduce_impl, _key)
    LIB.impl("fused_all_reduce_add_rms_norm", _fused_all_reduce_add_rms_norm_impl, _key)
