"""Quantised embedding: ``embedding_q`` (rows packed in a ``torch_topg.quant`` format).

The shipped SmolLM2 GGUF stores its token embedding as q8_0, tied to the LM head: with
``embedding_q`` and ``linear_q`` one packed tensor serves both.
"""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.formats import FORMATS
from torch_topg.ops._checks import FLOAT_DTYPES, Arg, check_op
from torch_topg.ops._library import eager_entry, register

_embedding_q = eager_entry("embedding_q")


def embedding_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    embedding_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``F.embedding(input, W)`` where ``W`` is ``weight`` de-quantised from ``format``.

    Args:
        input: int32 / int64 ids, any shape, each in ``[0, N)``.
        weight: uint8 ``[N, row_bytes(embedding_dim)]``, contiguous (see ``linear_q``).
        format: one of ``torch_topg.quant.FORMATS``.
        embedding_dim: ``D``, the weights per row.
        dtype: float32 / bfloat16 / float16, the output dtype.

    Returns:
        ``[*input.shape, D]`` in ``dtype``: the exactly de-quantised rows, rounded once.
    """
    if torch.compiler.is_compiling():
        return torch.ops.topg.embedding_q.default(input, weight, format, embedding_dim, dtype)
    return _embedding_q(input, weight, format, embedding_dim, dtype)


def _check_embedding_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    embedding_dim: int,
    dtype: torch.dtype = torch.float32,
) -> None:
    op = "embedding_q"
    Arg(op, "input", input).index()
    check_op(
        format in FORMATS,
        op,
        f"format '{format}' is not one of " + ", ".join(f"'{f}'" for f in FORMATS),
    )
    check_op(
        dtype in FLOAT_DTYPES,
        op,
        f"dtype {str(dtype).removeprefix('torch.')} is not one of float32, bfloat16, float16",
    )
    f = FORMATS[format]
    check_op(embedding_dim >= 0, op, f"embedding_dim {embedding_dim} is negative")
    problem = f.k_problem(embedding_dim)
    check_op(problem is None, op, f"embedding_dim {embedding_dim} is not {problem}")
    w = Arg(op, "weight", weight).dim(2).dtype((torch.uint8,)).same_device(input, "input")
    w.size(1, f.row_bytes(embedding_dim), f"the bytes of a {format} row of {embedding_dim} weights")
    w.contiguous()


def _fake_embedding_q(
    input: torch.Tensor,
    weight: torch.Tensor,
    format: str,
    embedding_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    return input.new_empty((*input.shape, embedding_dim), dtype=dtype)


register(
    "embedding_q",
    check=_check_embedding_q,
    fake=_fake_embedding_q,
    reference=reference.embedding_q,
    wrapper=embedding_q,
)
