"""An MoE layer for the decode plan (:mod:`torch_topg.compile.decode_plan`): what the
plan's MoE phases (``csrc/cpu/decode_plan_moe.h``) need from a transformers sparse MoE
block, found by probing the block, not by its family's name.

The block must be a router (``gate``: ``[E, H]`` weight, softmax top-k), experts
(``experts``: ``fused_moe``'s layout, or a :class:`~torch_topg.quant.QuantizedExperts`),
and optionally a shared expert (``shared_expert``: a SiLU-gated MLP) scaled by
``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE). The router's semantics are measured:
it is run on a probe input and its weights must equal the top-k softmax probabilities,
renormalised or not, returned in float32 (Mixtral) or rounded to the model dtype
(Qwen2-MoE, Qwen3-MoE, OLMoE). Anything else is :class:`Unsupported`, naming it.
"""

from __future__ import annotations

from typing import Any

import torch

#: The plan's MoE flags (``csrc/cpu/decode_plan.h``).
RENORMALIZE, ROUND_WEIGHTS, ACT_SHIFT = 1, 2, 2
#: fused_moe's activations, in the plan's order (moe::Act).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
#: The children a sparse MoE block may have.
BLOCK_CHILDREN = {"gate", "experts", "shared_expert", "shared_expert_gate"}


def is_moe(mlp: torch.nn.Module) -> bool:
    """Whether ``mlp`` is a sparse MoE block (a router and experts) rather than an MLP."""
    return hasattr(mlp, "experts") and hasattr(mlp, "gate") and not hasattr(mlp, "gate_proj")


def _router(gate: Any, name: str, dtype: torch.dtype) -> tuple[torch.Tensor, int, int]:
    """(weight, top_k, flags) of a router, its normalisation measured on a probe input."""
    from torch_topg.compile.plan_errors import Unsupported

    w = getattr(gate, "weight", None)
    k = getattr(gate, "top_k", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or not isinstance(k, int):
        raise Unsupported(f"{name}: a router without a [experts, hidden] weight and top_k")
    if any(isinstance(getattr(gate, b, None), torch.Tensor) for b in ("bias", "e_score_correction_bias")):  # fmt: skip
        raise Unsupported(f"{name}: router bias (biased expert selection)")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, w.shape[1], generator=g).to(dtype)
    with torch.inference_mode():
        try:
            out = gate(x)
        except Exception as e:  # a router with another signature
            raise Unsupported(
                f"{name}: probing the router failed ({type(e).__name__}: {e})"
            ) from None
        if not (isinstance(out, tuple) and len(out) == 3):
            raise Unsupported(f"{name}: the router does not return (logits, weights, indices)")
        logits, weights, idx = out
        want = torch.nn.functional.linear(x, w)
        probs = torch.softmax(want.float(), dim=-1)
        top, top_idx = torch.topk(probs, k, dim=-1)
        if not torch.equal(idx.long(), top_idx) or not torch.allclose(logits.float(), want.float()):
            raise Unsupported(f"{name}: the router is not a softmax top-{k} of x . weight")
        flags = 0
        if weights.dtype != torch.float32:
            if weights.dtype != dtype:
                raise Unsupported(f"{name}: router weights in {weights.dtype}")
            flags |= ROUND_WEIGHTS
        tol = dict(rtol=1e-2, atol=1e-3)
        if torch.allclose(weights.float(), top / top.sum(-1, keepdim=True), **tol) and not (
            torch.allclose(weights.float(), top, **tol)
        ):
            flags |= RENORMALIZE
        elif not torch.allclose(weights.float(), top, **tol):
            raise Unsupported(f"{name}: router weights are neither the top-{k} softmax "
                              "probabilities nor their renormalisation")  # fmt: skip
    return w, k, flags


def lower_moe(mlp: Any, name: str, dtype: torch.dtype, linear: Any) -> tuple[list, list, list]:
    """(weights, formats, [top_k, flags]) of slots 11-20 of a layer (``decode_plan.py``:
    the dense MLP's three empty, then router, experts and the shared expert), or
    :class:`Unsupported`. ``linear`` is decode_plan's ``_linear``."""
    from torch_topg.compile.plan_errors import Unsupported
    from torch_topg.ops.fused_moe import experts_activation, experts_supported
    from torch_topg.quant.experts import QuantizedExperts

    odd = sorted(n for n, _ in mlp.named_children() if n not in BLOCK_CHILDREN)
    if odd:
        raise Unsupported(f"{name} has {odd} (a sparse MoE block the plan does not know)")
    router, k, flags = _router(mlp.gate, f"{name}.gate", dtype)
    ex = mlp.experts
    if isinstance(ex, QuantizedExperts):
        act = ex.activation
        a8 = ":a8" if ex.int8_activations else ""
        gu, dn, fgu, fd = ex.qgate_up, ex.qdown, ex.format + a8, ex.down_format + a8
    else:
        why = experts_supported(ex)
        act = experts_activation(ex)
        if why is not None:
            raise Unsupported(f"{name}.experts: {why}")
        gu, dn, fgu, fd = ex.gate_up_proj, ex.down_proj, "", ""
    if act not in ACTIVATIONS:
        raise Unsupported(f"{name}.experts: activation {act!r}")
    flags |= ACTIVATIONS.index(act) << ACT_SHIFT
    empty = torch.empty(0, dtype=dtype)
    weights = [empty, empty, empty, router, gu, dn]
    formats = ["", "", "", "", fgu, fd]
    shared = getattr(mlp, "shared_expert", None)
    if shared is None:
        if getattr(mlp, "shared_expert_gate", None) is not None:
            raise Unsupported(f"{name}: a shared_expert_gate without a shared_expert")
        return weights + [empty] * 4, formats + [""] * 4, [k, flags]
    if getattr(mlp, "shared_expert_gate", None) is None:
        raise Unsupported(f"{name}: a shared expert without its gate (shared_expert_gate)")
    sact = getattr(shared, "act_fn", None)
    if type(sact).__name__ not in ("SiLU", "SiLUActivation") or {
        n for n, _ in shared.named_children()
    } != {"gate_proj", "up_proj", "down_proj", "act_fn"}:
        raise Unsupported(f"{name}.shared_expert is not a SiLU-gated MLP")
    parts = [
        linear(shared.gate_proj, f"{name}.shared_expert.gate_proj", False),
        linear(shared.up_proj, f"{name}.shared_expert.up_proj", False),
        linear(shared.down_proj, f"{name}.shared_expert.down_proj", False),
        linear(mlp.shared_expert_gate, f"{name}.shared_expert_gate", False),
    ]
    return weights + [w for w, _, _ in parts], formats + [f for _, _, f in parts], [k, flags]
