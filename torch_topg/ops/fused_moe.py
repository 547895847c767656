"""Grouped expert MLPs: ``fused_moe`` (gate/up GEMM with the activation fused, down GEMM)."""

from __future__ import annotations

import torch

from torch_topg import reference
from torch_topg.ops._checks import Arg, check_op
from torch_topg.ops._library import eager_entry, register

_fused_moe = eager_entry("fused_moe")

ACTIVATIONS = ("silu", "gelu", "gelu_tanh")


def fused_moe(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """Mixture-of-experts MLP over routed tokens.

    ``out[t] = sum_j topk_weights[t, j] * (act(x Wg[e]^T) * (x Wu[e]^T)) Wd[e]^T`` with
    ``e = topk_ids[t, j]``, ``x = hidden_states[t]``.

    Args:
        hidden_states: ``[T, H]``, float32 / bfloat16 / float16.
        w_gate_up: ``[E, 2I, H]`` contiguous, the dtype of ``hidden_states``; rows ``0..I-1``
            are the gate projection, ``I..2I-1`` the up projection (transformers'
            ``gate_up_proj``, vLLM's ``w13``).
        w_down: ``[E, H, I]`` contiguous, the dtype of ``hidden_states``.
        topk_weights: ``[T, k]`` float32 or the dtype of ``hidden_states``.
        topk_ids: ``[T, k]`` int32 / int64 expert ids in ``[0, E)``.
        activation: ``"silu"``, ``"gelu"`` (exact, erf) or ``"gelu_tanh"``.

    Returns:
        ``[T, H]`` in the dtype of ``hidden_states``; fp32 math, rounded once.
    """
    args = (hidden_states, w_gate_up, w_down, topk_weights, topk_ids)
    if torch.compiler.is_compiling():
        return torch.ops.topg.fused_moe.default(*args, activation=activation)
    return _fused_moe(*args, activation=activation)


def _check_fused_moe(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> None:
    op = "fused_moe"
    Arg(op, "hidden_states", hidden_states).dim(2).floating()
    hidden = hidden_states.shape[1]
    Arg(op, "w_gate_up", w_gate_up).dim(3).same_dtype(hidden_states, "hidden_states")
    Arg(op, "w_gate_up", w_gate_up).same_device(hidden_states, "hidden_states").size(
        2, hidden, "the hidden size of 'hidden_states'"
    ).contiguous()
    two_inter = w_gate_up.shape[1]
    torch._check(
        two_inter % 2 == 0,
        Arg(op, "w_gate_up", w_gate_up).message("an even size at dim 1 ([gate; up] rows)"),
    )
    Arg(op, "w_down", w_down).dim(3).same_dtype(hidden_states, "hidden_states")
    Arg(op, "w_down", w_down).same_device(hidden_states, "hidden_states").size(
        0, w_gate_up.shape[0], "the experts of 'w_gate_up'"
    ).size(1, hidden, "the hidden size of 'hidden_states'").size(
        2, two_inter // 2, "half of dim 1 of 'w_gate_up'"
    ).contiguous()
    check_routing(op, hidden_states, topk_weights, topk_ids, activation)


def check_routing(
    op: str,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str,
) -> None:
    """The routing arguments and the activation of ``fused_moe`` / ``fused_moe_q``."""
    tokens = hidden_states.shape[0]
    tw = Arg(op, "topk_weights", topk_weights).dim(2)
    if topk_weights.dtype != torch.float32:
        tw.same_dtype(hidden_states, "hidden_states")
    tw.size(0, tokens, "the tokens of 'hidden_states'").same_device(hidden_states, "hidden_states")
    Arg(op, "topk_ids", topk_ids).dim(2).index().same_device(hidden_states, "hidden_states").size(
        0, tokens, "the tokens of 'hidden_states'"
    ).size(1, topk_weights.shape[1], "the top-k of 'topk_weights'")
    check_op(
        activation in ACTIVATIONS,
        op,
        f"activation '{activation}' is not one of 'silu', 'gelu', 'gelu_tanh'",
    )


def _fake_fused_moe(
    hidden_states: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    return hidden_states.new_empty(hidden_states.shape)


register(
    "fused_moe",
    check=_check_fused_moe,
    fake=_fake_fused_moe,
    reference=reference.fused_moe,
    wrapper=fused_moe,
)
