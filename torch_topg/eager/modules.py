"""Module-level routing of transformers models while ``torch_topg.enable()`` is on.

Hugging Face decoders spend most of a decode step in per-op overhead: ``LlamaRMSNorm``
is six aten ops (to, pow, mean, add, rsqrt, mul, mul), rotary embedding about fifteen
(slices, neg, cat, mul, add for q and k). Intercepting aten ops cannot fuse those, so
enable() swaps the ``forward`` of recognised module classes for one that calls the
fused topg op, and disable() puts the original functions back.

A class is recognised by its code, not its name: its (undecorated) ``forward`` must
have exactly the bytecode, names and constants of the Llama implementation. transformers
generates most decoders from Llama ("modular" files), so Mistral, Mixtral, Qwen2,
SmolLM and many others match, while any model whose forward differs in the slightest
(Gemma's ``1 + weight``, partial rotary, q/k norms, biases handled differently) keeps
its own code. Each patched forward falls back to the original one whenever topg's
semantics could differ (gradients needed, mixed dtypes, attention weights requested,
an attention implementation other than sdpa / eager / topg).
"""

from __future__ import annotations

import inspect
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from torch_topg.eager import hf
from torch_topg.ops.norm import rms_norm
from torch_topg.ops.rotary import rotary_embedding

_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


def _code_key(fn: Callable) -> tuple | None:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return None
    return (code.co_code, code.co_names, code.co_consts, code.co_varnames)


# --- RMSNorm ------------------------------------------------------------------------------


def rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if (
        hidden_states.dtype != w.dtype
        or hidden_states.dtype not in _FLOAT
        or hidden_states.device != w.device
        or hf.needs_grad(hidden_states, w)
    ):
        return _originals[(type(self), "forward")](self, hidden_states)
    return rms_norm(hidden_states, w, float(self.variance_epsilon))


# --- attention ----------------------------------------------------------------------------

# One entry: the cos / sin of the current forward (shared by every layer) and the
# [B * S, D] cos_sin cache and positions topg's rotary op reads. HF's cos / sin are
# cat(freqs, freqs).cos() / .sin(), so the first half holds every distinct value.
# cos / sin may have batch 1 (shared positions) while q has batch B. Thread-local, so
# models running in several threads never see each other's entry.
_rope = threading.local()


def _rope_cache(
    cos: torch.Tensor, sin: torch.Tensor, bsz: int
) -> tuple[torch.Tensor, torch.Tensor]:
    entry = getattr(_rope, "entry", None)
    if entry is not None and entry[0] is cos and entry[1] is sin and entry[2] == bsz:
        return entry[3], entry[4]
    half = cos.shape[-1] // 2
    cos_sin = torch.cat((cos[..., :half], sin[..., :half]), dim=-1).reshape(-1, 2 * half)
    positions = torch.arange(cos_sin.shape[0], device=cos.device).view(cos.shape[:-1])
    positions = positions.expand(bsz, -1).contiguous()
    _rope.entry = (cos, sin, bsz, positions, cos_sin)
    return positions, cos_sin


def clear_rope_cache() -> None:
    _rope.entry = None


def attention_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    impl = getattr(self.config, "_attn_implementation", None)
    if "past_key_values" in kwargs and cache is None:
        cache = kwargs.pop("past_key_values")
    if (
        impl not in ("sdpa", "eager", "topg")
        or self.training
        or position_embeddings is None
        or kwargs.get("output_attentions")
        or hidden_states.dtype not in _FLOAT
        or hf.needs_grad(hidden_states, self.q_proj.weight)
        or position_embeddings[0].dtype != hidden_states.dtype
        or position_embeddings[0].dim() != 3
        or position_embeddings[0].shape[0] not in (1, hidden_states.shape[0])
    ):
        return _originals[(type(self), "forward")](
            self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs
        )
    bsz, q_len = hidden_states.shape[:2]
    d = self.head_dim
    q = self.q_proj(hidden_states)  # [B, S, Hq * D]
    k = self.k_proj(hidden_states)  # [B, S, Hkv * D]
    v = self.v_proj(hidden_states)
    positions, cos_sin = _rope_cache(*position_embeddings, bsz)
    rotary_embedding(positions, q, k, d, cos_sin, True)  # in place, neox (rotate_half)
    q = q.view(bsz, q_len, -1, d)
    k = k.view(bsz, q_len, -1, d).transpose(1, 2)  # [B, Hkv, S, D], what caches store
    v = v.view(bsz, q_len, -1, d).transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
    out = hf.run_attention(
        self,
        q.transpose(1, 2),
        k,
        v,
        attention_mask,
        self.scaling,
        kwargs.get("is_causal"),
        None,
        mask_is_causal=impl != "eager",
    )
    return self.o_proj(out.reshape(bsz, q_len, -1)), None


# --- registry --------------------------------------------------------------------------

#: (reference class path, attribute) -> topg replacement.
_REFERENCES: list[tuple[str, str, str, Callable]] = [
    ("transformers.models.llama.modeling_llama", "LlamaRMSNorm", "forward", rms_norm_forward),
    ("transformers.models.llama.modeling_llama", "LlamaAttention", "forward", attention_forward),
]

#: (class, attribute) -> original function, for every patched class.
_originals: dict[tuple[type, str], Callable] = {}


def _reference_keys() -> list[tuple[tuple, str, Callable]]:
    import importlib

    out = []
    for mod_name, cls_name, attr, repl in _REFERENCES:
        try:
            cls = getattr(importlib.import_module(mod_name), cls_name)
        except (ImportError, AttributeError):
            continue
        key = _code_key(cls.__dict__[attr])
        if key is not None:
            out.append((key, attr, repl))
    return out


def patch_module(module: ModuleType, refs: list[tuple[tuple, str, Callable]] | None = None) -> None:
    """Patch every recognised class defined in ``module`` (a transformers model file)."""
    refs = refs if refs is not None else _reference_keys()
    for obj in list(vars(module).values()):
        if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
            continue
        if obj.__module__ != module.__name__:
            continue
        for key, attr, repl in refs:
            fn = obj.__dict__.get(attr)
            if fn is None or (obj, attr) in _originals or _code_key(fn) != key:
                continue
            _originals[(obj, attr)] = fn
            setattr(obj, attr, repl)


def patch_loaded() -> None:
    """Patch the model files transformers has imported so far."""
    if "transformers" not in sys.modules:
        return
    refs = _reference_keys()
    for name, module in list(sys.modules.items()):
        if module is not None and name.startswith("transformers.models.") and ".modeling_" in name:
            patch_module(module, refs)


def unpatch_all() -> None:
    for (cls, attr), fn in _originals.items():
        setattr(cls, attr, fn)
    _originals.clear()
    clear_rope_cache()


def patched_classes() -> list[str]:
    return sorted(f"{c.__module__}.{c.__qualname__}.{a}" for c, a in _originals)
