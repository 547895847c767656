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


# --- which transformers experts modules fused_moe runs ------------------------------------

#: transformers (and torch) activation classes whose forward is one of fused_moe's
#: activations. The Python spellings (``GELUActivation(use_gelu_python=True)``,
#: ``NewGELUActivation``, ``FastGELUActivation``, ``GELUTanh(use_gelu_tanh_python=True)``)
#: compute the same function in the model dtype; fused_moe computes it in fp32 and rounds
#: once, so it differs from them by rounding only, as it does from the C spellings.
_EXPERT_ACTIVATIONS = {
    ("transformers.activations", "SiLUActivation"): "silu",
    ("torch.nn.modules.activation", "SiLU"): "silu",
    ("transformers.activations", "GELUActivation"): "gelu",
    ("transformers.activations", "GELUTanh"): "gelu_tanh",
    ("transformers.activations", "PytorchGELUTanh"): "gelu_tanh",
    ("transformers.activations", "NewGELUActivation"): "gelu_tanh",
    ("transformers.activations", "FastGELUActivation"): "gelu_tanh",
}


def experts_activation(module: torch.nn.Module) -> str | None:
    """``fused_moe``'s ``activation`` for an experts module's ``act_fn`` (``"silu"``,
    ``"gelu"``, ``"gelu_tanh"``), or None when it has none of them."""
    act = getattr(module, "act_fn", None)
    cls = type(act)
    return _EXPERT_ACTIVATIONS.get((cls.__module__, cls.__name__))


def experts_supported(module: torch.nn.Module) -> str | None:
    """Why ``fused_moe`` cannot run this transformers 5 experts module; None when it can.

    The one answer used by eager interception (``experts_implementation="topg"``), the
    compile backend's experts substitution and ``torch_topg.quantize``. It looks at the
    module only; each caller still checks its own call (dtypes, gradients, shapes of the
    hidden states). A module runs when it has ``fused_moe``'s layout and semantics:
    ``gate_up_proj`` ``[E, 2I, H]`` (gate rows, then up rows) and ``down_proj``
    ``[E, H, I]``, no biases, no post-expert norm, not expert parallel, transformers'
    default gate (``act(gate) * up``) and an activation of :func:`experts_activation`.
    Flags the module does not set take the defaults of transformers'
    ``use_experts_implementation`` (concatenated, not transposed, no bias, a gate).
    """
    if getattr(module, "has_bias", False) or any(
        getattr(module, name, None) is not None for name in ("gate_up_proj_bias", "down_proj_bias")
    ):
        return "experts with bias"
    if not getattr(module, "has_gate", True):
        return "experts without a gate projection"
    if getattr(module, "is_transposed", False):
        return "transposed expert weights"
    if not getattr(module, "is_concatenated", True):
        return "interleaved gate/up weights"
    if getattr(module, "has_post_expert_norm", False):
        return "post-expert norm"
    if getattr(module, "_is_expert_parallel", False):  # transformers' own flag
        return "expert parallel"
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is not None and getattr(apply_gate, "__name__", "") != "_default_apply_gate":
        return "custom gate function"
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not isinstance(gu, torch.Tensor) or not isinstance(down, torch.Tensor):
        return "no gate_up_proj / down_proj tensors"
    if (
        gu.dim() != 3
        or down.dim() != 3
        or gu.shape[0] != down.shape[0]
        or gu.shape[1] != 2 * down.shape[2]
        or gu.shape[2] != down.shape[1]
    ):
        return "expert weights are not [E, 2I, H] / [E, H, I]"
    if experts_activation(module) is None:
        return f"activation {type(getattr(module, 'act_fn', None)).__name__}"
    return None
