"""Weight-only quantised linear: ``linear_q`` (packed weights of ``torch_topg.quant``)."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.formats import FORMATS
from torch_topg.ops._checks import Arg, check_op
from torch_topg.ops._library import eager_entry, register

_linear_q = eager_entry("linear_q")


def linear_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    bias: torch.Tensor | None = None,
    *,
    int8_activations: bool = False,
) -> torch.Tensor:
    """``input @ W.T + bias`` where ``W`` is ``weight`` de-quantised from ``format``.

    Args:
        input: ``[..., K]``, float32 / bfloat16 / float16, any layout.
        weight: uint8 ``[N, row_bytes]``, contiguous: each row is ``K`` weights packed in
            ``format`` (``torch_topg.quant.quantize_weight``, or a GGUF tensor's bytes);
            ``row_bytes = torch_topg.quant.get_format(format).row_bytes(K)``.
        format: one of ``torch_topg.quant.FORMATS``: ``"q8_0"``, ``"q4_0"``, ``"q4_1"``,
            ``"q4_k"``, ``"q5_k"``, ``"q6_k"`` (K a multiple of the block, 32 or 256), ``"int8"``,
            ``"int4_g32"``, ``"int4_g64"``, ``"int4_g128"`` (any K).
        bias: ``[N]`` in the dtype of ``input``, or None.
        int8_activations: quantise ``input`` to int8 first, one scale per group of 32 (per
            256 for the K-quants: ``torch_topg.formats.activation_group``;
            ``torch_topg.formats.quantize_activations``: scale ``amax / 127``, round to
            nearest even), as llama.cpp does, so the CPU GEMV runs integer dot products;
            about 1.7x faster on 4-bit weights in cache, ~0.5% off the exact product.

    Returns:
        ``[..., N]`` in the dtype of ``input``; the reference accumulates in fp32 over the
        exactly de-quantised weights (and the rounded activations) and rounds once.
    """
    if torch.compiler.is_compiling():
        return torch.ops.topg.linear_q.default(
            input, weight, format, bias, int8_activations=int8_activations
        )
    return _linear_q(input, weight, format, bias, int8_activations=int8_activations)


def _check_linear_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    bias: torch.Tensor | None = None,
    *,
    int8_activations: bool = False,
) -> None:
    op = "linear_q"
    Arg(op, "input", input).min_dim(1).floating()
    check_op(
        format in FORMATS,
        op,
        f"format '{format}' is not one of " + ", ".join(f"'{f}'" for f in FORMATS),
    )
    f = FORMATS[format]
    k = input.shape[-1]
    if f.block and not f.pads:
        x = Arg(op, "input", input)
        torch._check(
            k % f.block == 0,
            x.message(f"a last dimension that is a multiple of {f.block} (the block of {format})"),
        )
    w = Arg(op, "weight", weight).dim(2).dtype((torch.uint8,)).same_device(input, "input")
    w.size(1, f.row_bytes(k), f"the bytes of a {format} row of {k} weights").contiguous()
    if bias is not None:
        Arg(op, "bias", bias).dim(1).same_dtype(input, "input").same_device(input, "input").size(
            0, weight.shape[0], "the output features of 'weight'"
        )


def _fake_linear_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    bias: torch.Tensor | None = None,
    *,
    int8_activations: bool = False,
) -> torch.Tensor:
    return input.new_empty((*input.shape[:-1], weight.shape[0]))


register(
    "linear_q",
    check=_check_linear_q,
    fake=_fake_linear_q,
    reference=reference.linear_q,
    wrapper=linear_q,
)
