"""Grouped expert MLPs over packed quantised weights: ``fused_moe_q`` (``fused_moe`` whose
expert weights are in a ``torch_topg.quant`` format, as a GGUF MoE file stores them)."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.formats import FORMATS
from torch_topg.ops._checks import Arg, check_op
from torch_topg.ops._library import eager_entry, register
from torch_topg.ops.fused_moe import check_routing

_fused_moe_q = eager_entry("fused_moe_q")


def fused_moe_q(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    format: str,
    *,
    down_format: str | None = None,
    activation: str = "silu",
    int8_activations: bool = False,
) -> torch.Tensor:
    """``fused_moe`` with each expert's weights packed in ``format``.

    ``out[t] = sum_j topk_weights[t, j] * (act(x Wg[e]^T) * (x Wu[e]^T)) Wd[e]^T`` with
    ``e = topk_ids[t, j]``, ``x = hidden_states[t]`` and the ``W`` de-quantised.

    Args:
        hidden_states: ``[T, H]``, float32 / bfloat16 / float16.
        w_gate_up: uint8 ``[E, 2I, row_bytes(H)]`` contiguous: expert ``e``'s ``2I`` rows
            of ``H`` weights packed in ``format`` (gate rows ``0..I-1``, up rows
            ``I..2I-1``; ``torch_topg.quant.quantize_weight`` of each expert's
            ``[2I, H]``, or a GGUF file's stacked ``ffn_gate_exps`` / ``ffn_up_exps``).
        w_down: uint8 ``[E, H, row_bytes(I)]`` contiguous, packed in ``down_format``.
        topk_weights: ``[T, k]`` float32 or the dtype of ``hidden_states``.
        topk_ids: ``[T, k]`` int32 / int64 expert ids in ``[0, E)``.
        format: the format of ``w_gate_up`` (one of ``torch_topg.quant.FORMATS``; the
            GGUF block formats need ``H`` a multiple of their block).
        down_format: the format of ``w_down`` (default: ``format``; a Q4_K_M file keeps
            some down projections in Q6_K).
        activation: ``"silu"``, ``"gelu"`` (exact, erf) or ``"gelu_tanh"``.
        int8_activations: round ``x`` and the intermediate ``h`` to int8 before their
            products, as ``linear_q(..., int8_activations=True)`` rounds its input for the
            gate/up and the down format (one scale per 32, per 256 for the K-quants).

    Returns:
        ``[T, H]`` in the dtype of ``hidden_states``; fp32 math, rounded once.
    """
    args = (hidden_states, w_gate_up, w_down, topk_weights, topk_ids, format)
    kw = dict(down_format=down_format, activation=activation, int8_activations=int8_activations)
    if torch.compiler.is_compiling():
        return torch.ops.topg.fused_moe_q.default(*args, **kw)
    return _fused_moe_q(*args, **kw)


def _check_format(op: str, name: str) -> None:
    check_op(
        name in FORMATS,
        op,
        f"format '{name}' is not one of " + ", ".join(f"'{f}'" for f in FORMATS),
    )


def _check_stack(op: str, arg: str, w: torch.Tensor, ref: torch.Tensor, fmt: str, k: int) -> Arg:
    a = Arg(op, arg, w).dim(3).dtype((torch.uint8,)).same_device(ref, "hidden_states")
    what = f"the bytes of a {fmt} row of {k} weights"
    return a.size(2, FORMATS[fmt].row_bytes(k), what).contiguous()


def _check_fused_moe_q(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    format: str,
    *,
    down_format: str | None = None,
    activation: str = "silu",
    int8_activations: bool = False,
) -> None:
    op = "fused_moe_q"
    Arg(op, "hidden_states", hidden_states).dim(2).floating()
    dfmt = format if down_format is None else down_format
    _check_format(op, format)
    _check_format(op, dfmt)
    hidden = hidden_states.shape[1]

    def whole_blocks(fmt: str, k: int, what: str) -> None:
        f = FORMATS[fmt]
        check_op(
            not f.block or f.pads or k % f.block == 0,
            op,
            f"{what} {k} is not a multiple of {f.block} (the block of {fmt})",
        )

    whole_blocks(format, hidden, "the hidden size")
    Arg(op, "w_gate_up", w_gate_up).dim(3)
    torch._check(
        w_gate_up.shape[1] % 2 == 0,
        Arg(op, "w_gate_up", w_gate_up).message("an even size at dim 1 ([gate; up] rows)"),
    )
    _check_stack(op, "w_gate_up", w_gate_up, hidden_states, format, hidden)
    experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    whole_blocks(dfmt, inter, "the intermediate size")
    _check_stack(op, "w_down", w_down, hidden_states, dfmt, inter).size(
        0, experts, "the experts of 'w_gate_up'"
    ).size(1, hidden, "the hidden size of 'hidden_states'")
    check_routing(op, hidden_states, topk_weights, topk_ids, activation)


def _fake_fused_moe_q(hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)


register(
    "fused_moe_q",
    check=_check_fused_moe_q,
    fake=_fake_fused_moe_q,
    reference=reference.fused_moe_q,
    wrapper=fused_moe_q,
)
