"""Gated activations: ``silu_and_mul`` and ``gelu_and_mul``."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.ops._checks import Arg, check_op
from torch_topg.ops._library import eager_entry, register

_silu_and_mul = eager_entry("silu_and_mul")
_gelu_and_mul = eager_entry("gelu_and_mul")


def silu_and_mul(input: torch.Tensor) -> torch.Tensor:
    """``silu(input[..., :d]) * input[..., d:]`` (SwiGLU; Llama, Mistral, Qwen MLPs).

    Args:
        input: ``[..., 2 * d]``: gate then up, as a fused gate/up projection produces.
            float32 / bfloat16 / float16.

    Returns:
        ``[..., d]`` in the dtype of ``input``.
    """
    if torch.compiler.is_compiling():
        return torch.ops.topg.silu_and_mul.default(input)
    return _silu_and_mul(input)


def gelu_and_mul(input: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(input[..., :d], approximate) * input[..., d:]`` (GeGLU; Gemma MLPs).

    Args:
        input: ``[..., 2 * d]``, gate then up. float32 / bfloat16 / float16.
        approximate: ``"none"`` (exact erf GELU) or ``"tanh"``.

    Returns:
        ``[..., d]`` in the dtype of ``input``.
    """
    if torch.compiler.is_compiling():
        return torch.ops.topg.gelu_and_mul.default(input, approximate)
    return _gelu_and_mul(input, approximate)


def _check_gated(op: str, input: torch.Tensor) -> None:
    a = Arg(op, "input", input).min_dim(1).floating()
    if input.shape[-1] % 2 != 0:
        a.fail("an even last dimension (gate | up)")


def _gated_fake(input: torch.Tensor, *args: object) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


def _check_gelu(input: torch.Tensor, approximate: str = "none") -> None:
    _check_gated("gelu_and_mul", input)
    check_op(
        approximate in ("none", "tanh"),
        "gelu_and_mul",
        f"argument 'approximate' expected 'none' or 'tanh', got '{approximate}'",
    )


register(
    "silu_and_mul",
    check=lambda input: _check_gated("silu_and_mul", input),
    wrapper=silu_and_mul,
    fake=_gated_fake,
    reference=reference.silu_and_mul,
)
register(
    "gelu_and_mul",
    check=_check_gelu,
    fake=_gated_fake,
    reference=reference.gelu_and_mul,
    wrapper=gelu_and_mul,
)
