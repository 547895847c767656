"""Which transformers models the engine runs: found by probing features, not by a list.

The engine runs a model's own transformers code with its attention routed to the paged
cache (:mod:`torch_topg.engine.attention`), so any decoder-only causal LM whose attention
layers call transformers' attention interface runs, whatever its family: GQA, per-layer
sliding windows mixed with global layers, QK-norm, logit softcapping, attention sinks
(transformers' ``s_aux``, passed to the kernel as ``sinks``), partial rotary, layers
without rotary, post-norms, multipliers, MoE blocks and tied embeddings are all the
model's code around the attention call (MoE experts that ``topg::fused_moe`` does not
cover run their own transformers code). What the engine cannot run is refused
before any weight loads, by :func:`check_supported`, naming the feature:

* an encoder-decoder model, or a config with no causal LM class in transformers;
* attention outside transformers' attention interface (``_supports_attention_backend``
  unset on the model class);
* layers that are not attention layers (``layer_types`` other than ``full_attention`` /
  ``sliding_attention``: linear attention, Mamba, ...), chunked attention, KV shared
  across layers;
* attention modules without ``layer_idx`` (the paged cache is indexed by it).

The module probes run on the model itself (``from_model``) or on a copy built on the
``meta`` device from the config (``from_pretrained``: no memory, no weights).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_topg.engine.errors import ParameterError

#: the attention layer kinds the paged attention function computes
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class UnsupportedModel(ParameterError):
    """A model the engine cannot run; ``feature`` names what it lacks."""

    def __init__(self, feature: str, detail: str) -> None:
        super().__init__("model", f"the engine does not run {feature}: {detail}")
        self.feature = feature


def causal_lm_class(config: Any) -> type | None:
    """transformers' causal LM class for ``config`` (None: there is none)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError:
        return None


def check_config(config: Any) -> None:
    """The features a config declares (see the module docstring)."""
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModel("encoder-decoder models", f"model_type {kind!r}")
    cls = causal_lm_class(config)
    if cls is None:
        raise UnsupportedModel(
            "models without a causal LM class",
            f"transformers maps no AutoModelForCausalLM class to {type(config).__name__}",
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    other = sorted(set(getattr(text, "layer_types", None) or ()) - set(ATTENTION_LAYER_TYPES))
    if other:
        raise UnsupportedModel("layers other than attention layers", f"layer_types {other}")
    if not getattr(cls, "_supports_attention_backend", False):
        raise UnsupportedModel(
            "attention outside transformers' attention interface",
            f"{cls.__name__} computes attention in its own code, so it cannot reach the "
            "paged cache",
        )
    if getattr(text, "attention_chunk_size", None):
        raise UnsupportedModel("chunked attention", f"attention_chunk_size={text.attention_chunk_size}")  # fmt: skip
    if getattr(text, "num_kv_shared_layers", 0):
        raise UnsupportedModel("KV shared across layers", f"num_kv_shared_layers={text.num_kv_shared_layers}")  # fmt: skip


def check_modules(model: torch.nn.Module) -> None:
    """The features only the modules show: each attention module's ``layer_idx``
    (transformers names its attention classes ``...Attention``)."""
    attention = [(n, m) for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    if not attention:
        raise UnsupportedModel(
            "models whose attention modules it cannot find",
            f"{type(model).__name__} has no module class named ...Attention",
        )
    for name, mod in attention:
        if getattr(mod, "layer_idx", None) is None:
            raise UnsupportedModel("attention modules without layer_idx", f"{name} has none")  # fmt: skip


def check_supported(config: Any, model: torch.nn.Module | None = None) -> None:
    """Refuse, naming the feature, what the engine cannot run. ``model``: the built model
    (``from_model``); without it the modules are probed on a ``meta``-device copy."""
    check_config(config)
    if model is None:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    check_modules(model)
