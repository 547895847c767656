"""Hugging Face transformers integration: ``topg`` attention and experts functions.

``import torch_topg`` makes ``from_pretrained(..., attn_implementation="topg",
experts_implementation="topg")`` work: the functions below are registered under the
name ``topg`` in transformers' ``AttentionInterface`` and ``ExpertsInterface`` as soon
as transformers itself is imported (an import hook, so importing torch_topg never
imports transformers, which takes seconds). Nothing happens without transformers or
with a version that has no such interfaces (transformers < 5).

``torch_topg.enable()`` additionally points the interfaces' ``sdpa`` / ``eager``
attention entries and ``eager`` / ``grouped_mm`` / ``batched_mm`` experts entries at
topg, so models built with those implementations run topg too; ``disable()`` puts the
saved entries back.

Each function falls back to what the slot it serves would have run (transformers' SDPA
function, the model file's ``eager_attention_forward``, the experts' eager forward)
whenever topg's semantics could differ: gradients needed, dropout, attention weights
requested, attention sinks, position biases, biased / transposed / interleaved experts.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from torch_topg.ops.attention import attention
from torch_topg.ops.fused_moe import experts_activation, experts_supported, fused_moe

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def needs_grad(*ts: torch.Tensor | None) -> bool:
    """Whether autograd would record a call on these tensors (topg's kernels have no
    backward: the callers then run the original code)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


# --- attention -------------------------------------------------------------------------


def _attention_supported(query, key, value, mask, dropout, kwargs) -> bool:
    if dropout > 0 or kwargs.get("output_attentions") or needs_grad(query, key, value):
        return False
    if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
        return False
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4 or query.dtype not in _FLOAT:
        return False
    if key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    if key.shape[-1] != query.shape[-1] or value.shape[-1] != query.shape[-1]:
        return False
    if query.shape[1] % key.shape[1] != 0 or query.shape[0] != key.shape[0]:
        return False
    return mask is None or mask.dim() <= 4


def run_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    is_causal: bool | None,
    softcap: float | None,
    mask_is_causal: bool,
) -> torch.Tensor:
    """topg attention on transformers' ``[B, H, S, D]`` tensors -> ``[B, Sq, Hq, D]``.

    ``mask_is_causal``: the caller's semantics put causality in the mask whenever there
    is one (SDPA's rule: ``is_causal`` only when ``attention_mask is None``); eager
    attention never applies causality without a mask.
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = False
    if mask_is_causal:
        causal_flag = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(q_len > 1 and attention_mask is None and causal_flag)
        if causal and kv_len > q_len:
            # Same as transformers' SDPA path: only an empty static cache gets here.
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    return attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=causal,
        scale=scaling,
        softcap=float(softcap or 0.0),
        mask=attention_mask,
    )


def _make_attention_fn(fallback: Callable[[torch.nn.Module], Callable], mask_is_causal: bool):
    def topg_attention_forward(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if not _attention_supported(query, key, value, attention_mask, dropout, kwargs):
            return fallback(module)(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                is_causal=is_causal,
                **kwargs,
            )
        out = run_attention(
            module,
            query,
            key,
            value,
            attention_mask,
            scaling,
            is_causal,
            kwargs.get("softcap"),
            mask_is_causal,
        )
        return out, None

    return topg_attention_forward


def _sdpa_fn(module: torch.nn.Module) -> Callable:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _eager_fn(module: torch.nn.Module) -> Callable:
    """The model file's own ``eager_attention_forward`` (what the "eager" slot means)."""
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return fn if fn is not None else _sdpa_fn(module)


#: ``attn_implementation="topg"``: SDPA semantics (causal when there is no mask).
topg_attention_forward = _make_attention_fn(_sdpa_fn, mask_is_causal=True)
#: Serves the "eager" slot while enabled: causality only through the mask, like eager.
topg_eager_attention_forward = _make_attention_fn(_eager_fn, mask_is_causal=False)


# --- experts -----------------------------------------------------------------------------


def _call_activation(self: torch.nn.Module, hidden: torch.Tensor, ids: torch.Tensor) -> str | None:
    """fused_moe's activation for this call, or None: the module is one fused_moe runs
    (:func:`experts_supported`) and the call is one it computes the same."""
    if experts_supported(self) is not None:
        return None
    w13, w2 = self.gate_up_proj, self.down_proj
    if hidden.dim() != 2 or hidden.dtype not in _FLOAT or w13.dtype != hidden.dtype:
        return None
    if w2.dtype != hidden.dtype or not (w13.is_contiguous() and w2.is_contiguous()):
        return None
    if needs_grad(hidden, w13, w2):
        return None
    return experts_activation(self)


def _make_experts_fn(fallback: Callable[[torch.nn.Module], Callable]):
    def topg_experts_forward(
        self: torch.nn.Module,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
    ) -> torch.Tensor:
        act = _call_activation(self, hidden_states, top_k_index)
        if act is None:
            return fallback(self)(self, hidden_states, top_k_index, top_k_weights)
        return fused_moe(
            hidden_states,
            self.gate_up_proj,
            self.down_proj,
            top_k_weights,
            top_k_index,
            activation=act,
        )

    return topg_experts_forward


def _eager_experts(self: torch.nn.Module) -> Callable:
    # use_experts_implementation wraps the class's own forward with functools.wraps.
    return type(self).forward.__wrapped__


#: ``experts_implementation="topg"`` (and the "eager" slot while enabled).
topg_experts_forward = _make_experts_fn(_eager_experts)


# --- registration --------------------------------------------------------------------


def _interfaces() -> tuple[Any, Any] | tuple[None, None]:
    """transformers' (AttentionInterface, ExpertsInterface) classes, if it has them."""
    mu = sys.modules.get("transformers.modeling_utils")
    moe = sys.modules.get("transformers.integrations.moe")
    return getattr(mu, "AttentionInterface", None), getattr(moe, "ExpertsInterface", None)


def register() -> None:
    """Add ``topg`` to whichever interfaces are imported (idempotent)."""
    attn, experts = _interfaces()
    if attn is not None and hasattr(attn, "_global_mapping"):
        attn._global_mapping["topg"] = topg_attention_forward
    if experts is not None and hasattr(experts, "_global_mapping"):
        experts._global_mapping["topg"] = topg_experts_forward


_MISSING = object()
#: (mapping, key) -> entry before enable() (``_MISSING``: there was none).
_saved: dict[tuple[int, str], tuple[dict, str, object]] = {}


def _swap(mapping: dict, key: str, fn: Callable) -> None:
    if (id(mapping), key) not in _saved:
        _saved[(id(mapping), key)] = (mapping, key, mapping.get(key, _MISSING))
    mapping[key] = fn


def route_interfaces() -> None:
    """enable(): point the sdpa / eager (attention) and eager / grouped_mm / batched_mm
    (experts) entries at topg, remembering what they were."""
    attn, experts = _interfaces()
    if attn is not None and hasattr(attn, "_global_mapping"):
        m = attn._global_mapping
        _swap(m, "sdpa", topg_attention_forward_routed)
        _swap(m, "eager", topg_eager_attention_forward)
    if experts is not None and hasattr(experts, "_global_mapping"):
        m = experts._global_mapping
        _swap(m, "eager", topg_experts_forward)
        for name in ("grouped_mm", "batched_mm"):
            orig = _saved.get((id(m), name), (None, None, m.get(name, _MISSING)))[2]
            if orig is not _MISSING:
                _swap(m, name, _make_experts_fn(lambda self, f=orig: f))


def unroute_interfaces() -> None:
    """disable(): restore every entry route_interfaces() changed."""
    for mapping, key, old in _saved.values():
        if old is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = old
    _saved.clear()


def _saved_sdpa(module: torch.nn.Module) -> Callable:
    attn, _ = _interfaces()
    entry = _saved.get((id(attn._global_mapping), "sdpa")) if attn is not None else None
    return entry[2] if entry is not None and entry[2] is not _MISSING else _sdpa_fn(module)


#: Serves the "sdpa" slot while enabled; falls back to the saved sdpa entry.
topg_attention_forward_routed = _make_attention_fn(_saved_sdpa, mask_is_causal=True)
