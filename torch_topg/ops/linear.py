"""Dense linear: ``linear`` (``F.linear`` semantics; GEMV / small-M / packed GEMM on CPU)."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.ops._checks import Arg
from torch_topg.ops._library import eager_entry, register

_linear = eager_entry("linear")


def linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``input @ weight.T + bias``, like ``torch.nn.functional.linear``.

    Args:
        input: ``[..., K]``, float32 / bfloat16 / float16, any layout.
        weight: ``[N, K]``, the dtype of ``input``, contiguous.
        bias: ``[N]`` in the dtype of ``input``, or None.

    Returns:
        ``[..., N]`` in the dtype of ``input``. Accumulation is fp32, rounded once.
    """
    if torch.compiler.is_compiling():
        return torch.ops.topg.linear.default(input, weight, bias)
    return _linear(input, weight, bias)


def _check_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    op = "linear"
    Arg(op, "input", input).min_dim(1).floating()
    Arg(op, "weight", weight).dim(2).same_dtype(input, "input").same_device(input, "input")
    Arg(op, "weight", weight).size(1, input.shape[-1], "the last dim of 'input'").contiguous()
    if bias is not None:
        Arg(op, "bias", bias).dim(1).same_dtype(input, "input").same_device(input, "input").size(
            0, weight.shape[0], "the output features of 'weight'"
        )


def _fake_linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


register(
    "linear", check=_check_linear, fake=_fake_linear, reference=reference.linear, wrapper=linear
)
