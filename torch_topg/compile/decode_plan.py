"""The decode step as one native call: lowering a model to ``topg.DecodePlan``.

The engine's decode batches (every sequence one new token) run on a plan built once
from the model's own tensors (``csrc/cpu/decode_plan.cpp``): one call per step, no
Python, no dispatcher, one team of threads for the whole step (docs/decode-step.md).
Prefill chunks, speculative verify steps and anything :func:`lower` refuses stay on the
compiled graph, and the reason is kept (``engine.stats()["decode_plan"]``).

What the plan computes is the Llama decoder: token embedding; per layer RMSNorm, q / k /
v projections (optional biases; Qwen3's per-head q / k RMSNorm), neox rotary from the model's own rotary module, paged
attention (GQA, optional sliding window), o projection, residual, RMSNorm, SiLU-gated
MLP, residual; final RMSNorm and the LM head. :func:`lower` checks a model is exactly
that, module by module, and otherwise says what differs. Projections, the LM head and
the embedding may be quantised (``torch_topg.quantize``, ``quantization="gguf"``): the
plan multiplies packed rows with ``linear_q``'s kernel (fp32 activations).

It lives below the engine because two callers lower models: the engine's model runner
and the compile backend's static-cache decode (:mod:`torch_topg.compile.static_plan`).
"""

from __future__ import annotations

from typing import Any

import torch

#: transformers model types whose decoder layer is the one the plan computes.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class Unsupported(Exception):
    """Why a model (or an engine configuration) does not lower; the engine keeps the text."""


class StalePlan(RuntimeError):
    """A weight the plan holds was converted, resized or moved since it was lowered
    (``model.to(dtype)``, a new storage through ``.data``): lower the model again."""


def run(plan: Any, *args: torch.Tensor) -> torch.Tensor:
    """``plan.run(*args)``; a refusal because a bound weight changed is a :class:`StalePlan`
    (the plan says so through ``stale()``), any other error is raised as it is."""
    try:
        return plan.run(*args)
    except RuntimeError:
        why = plan.stale()
        if why:
            raise StalePlan(why) from None
        raise


def _linear(mod: Any, name: str, bias_ok: bool) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """(weight, bias, format): the weight in the model dtype (format ``""``), or a
    :class:`~torch_topg.quant.QuantizedLinear`'s packed rows and their format."""
    from torch_topg.quant.modules import QuantizedLinear

    if mod.bias is not None and not bias_ok:
        raise Unsupported(f"{name} has a bias")
    if type(mod) is QuantizedLinear:
        return mod.qweight, mod.bias, mod.format + (":a8" if mod.int8_activations else "")
    if type(mod) is not torch.nn.Linear:
        raise Unsupported(f"{name} is {type(mod).__name__}, not torch.nn.Linear or QuantizedLinear")
    return mod.weight, mod.bias, ""


def _embedding(mod: Any, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    from torch_topg.quant.modules import QuantizedEmbedding

    if type(mod) is QuantizedEmbedding:
        if mod.dtype_ref.dtype != dtype:
            raise Unsupported(f"embed_tokens returns {mod.dtype_ref.dtype}, the model is {dtype}")
        if mod.embed_scale is not None:
            raise Unsupported(f"embed_tokens scales its rows by {mod.embed_scale:g}")
        return mod.qweight, mod.format
    if type(mod) is not torch.nn.Embedding:
        raise Unsupported(f"embed_tokens is {type(mod).__name__}")
    return mod.weight, ""


def _rms(mod: Any, name: str) -> tuple[torch.Tensor, float]:
    if not type(mod).__name__.endswith("RMSNorm") or "Gemma" in type(mod).__name__:
        raise Unsupported(f"{name} is {type(mod).__name__}, not a Llama-style RMSNorm")
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    if eps is None or not isinstance(mod.weight, torch.Tensor):
        raise Unsupported(f"{name}: no weight / epsilon")
    return mod.weight, float(eps)


def _rotary_table(base: Any, config: Any, positions: int, dtype: torch.dtype) -> torch.Tensor:
    """``[positions, head_dim]`` rows ``[cos_0..cos_{h-1}, sin_0..sin_{h-1}]`` computed by
    the model's own rotary module (its scaling included), in the model dtype, as the
    compiled graph's rotary pass takes them."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    kind = (
        rope.get("rope_type", rope.get("type", "default")) if isinstance(rope, dict) else "default"
    )
    if kind in ("dynamic", "longrope"):
        raise Unsupported(f"rope_type {kind!r} changes its frequencies with the length")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise Unsupported("partial rotary")
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise Unsupported("no model.rotary_emb module")
    pos = torch.arange(positions, device="cpu")[None]
    x = torch.empty(1, dtype=dtype)
    with torch.inference_mode():
        cos, sin = rotary(x, pos)
    half = cos.shape[-1] // 2
    if not (
        torch.equal(cos[..., :half], cos[..., half:])
        and torch.equal(sin[..., :half], sin[..., half:])
    ):
        raise Unsupported("rotary cos / sin halves differ (not neox-style)")
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], -1).to(dtype).contiguous()


def lower(model: torch.nn.Module, kv_caches: list[torch.Tensor], *, block_size: int,
          max_positions: int, cache_layout: str = "paged") -> Any:  # fmt: skip
    """A ``torch.classes.topg.DecodePlan`` for ``model`` over ``kv_caches`` (``[K, V]`` per
    layer); raises :class:`Unsupported` naming what does not fit.

    ``cache_layout``: ``"paged"`` (the engine's ``[blocks, block_size, kv_heads, head_dim]``)
    or ``"bhsd"`` (transformers' ``StaticCache``, ``[batch, kv_heads, max_len, head_dim]``:
    each batch row is one block of ``block_size = max_len``).

    The plan holds the parameters themselves (not copies): updates of their values are
    seen at the next step, and a parameter converted or moved through ``.data`` (e.g.
    ``model.to(dtype)``) makes ``run`` refuse as stale, after which the runner lowers
    again. A parameter *object* replaced on its module is not seen: call
    ``ModelRunner.relower()`` after that."""
    from torch_topg import _native

    if not _native.load() or not hasattr(torch.classes.topg, "DecodePlan"):
        raise Unsupported(f"native library not loaded ({_native.missing_reason('cpu')})")
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = getattr(text, "model_type", None)
    if kind not in MODEL_TYPES:
        raise Unsupported(f"model_type {kind!r} is not lowered (lowered: {', '.join(MODEL_TYPES)})")
    p = model.model.norm.weight if hasattr(model, "model") else next(model.parameters())
    if p.device.type != "cpu":
        raise Unsupported(
            f"device {p.device.type}: the plan runs on the CPU (CUDA: CUDA graphs, not yet)"
        )
    dtype = p.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"dtype {dtype}")
    if any(t.dtype != dtype for t in kv_caches):
        raise Unsupported("KV cache dtype differs from the model's (int8 KV cache)")
    if getattr(text, "hidden_act", "silu") not in ("silu", "swish"):
        raise Unsupported(f"hidden_act {text.hidden_act!r}")
    if getattr(text, "attn_logit_softcapping", None):
        raise Unsupported("attention logit softcapping")
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(model, "lm_head"):
        raise Unsupported("not a <Model>ForCausalLM with .model.layers and .lm_head")
    if len(kv_caches) != 2 * len(layers):
        raise Unsupported(f"{len(kv_caches)} KV tensors for {len(layers)} layers")
    embed, embed_fmt = _embedding(base.embed_tokens, dtype)
    final_norm, eps = _rms(base.norm, "model.norm")
    lm_head, _, head_fmt = _linear(model.lm_head, "lm_head", bias_ok=False)
    weights = [embed, final_norm, lm_head]
    formats = [embed_fmt, "", head_fmt]
    windows: list[int] = []
    scale = None
    empty = torch.empty(0, dtype=dtype)
    for i, layer in enumerate(layers):
        at, mlp = layer.self_attn, layer.mlp
        if isinstance(getattr(at, "sinks", None), torch.Tensor):  # the plan has no sink term
            raise Unsupported(f"layers.{i}.self_attn.sinks (attention sinks)")
        extra = {"pre_feedforward_layernorm", "post_feedforward_layernorm"}
        found = sorted(n for n, _ in layer.named_children() if n in extra) + sorted(
            n for n, _ in at.named_children() if n in extra
        )
        if found:
            raise Unsupported(f"layers.{i} has {found}")
        ln_in, e1 = _rms(layer.input_layernorm, f"layers.{i}.input_layernorm")
        ln_post, e2 = _rms(layer.post_attention_layernorm, f"layers.{i}.post_attention_layernorm")
        if e1 != eps or e2 != eps:
            raise Unsupported("RMSNorm epsilons differ between layers")
        wq, bq, fq = _linear(at.q_proj, f"layers.{i}.self_attn.q_proj", True)
        wk, bk, fk = _linear(at.k_proj, f"layers.{i}.self_attn.k_proj", True)
        wv, bv, fv = _linear(at.v_proj, f"layers.{i}.self_attn.v_proj", True)
        wo, _, fo = _linear(at.o_proj, f"layers.{i}.self_attn.o_proj", False)
        wg, _, fg = _linear(mlp.gate_proj, f"layers.{i}.mlp.gate_proj", False)
        wu, _, fu = _linear(mlp.up_proj, f"layers.{i}.mlp.up_proj", False)
        wd, _, fd = _linear(mlp.down_proj, f"layers.{i}.mlp.down_proj", False)
        heads = []
        for nm in ("q_norm", "k_norm"):  # Qwen3: RMSNorm over each head before rotary
            mod = getattr(at, nm, None)
            if mod is None:
                heads.append(empty)
                continue
            w, e = _rms(mod, f"layers.{i}.self_attn.{nm}")
            if e != eps:
                raise Unsupported(f"layers.{i}.self_attn.{nm}: epsilon differs from the layers'")
            heads.append(w)
        s = float(at.scaling)
        if scale is not None and s != scale:
            raise Unsupported("attention scaling differs between layers")
        scale = s
        # The window transformers passes to the attention function: Mistral's from the
        # config, Qwen2 / Qwen3's per layer from the module (None on full-attention layers).
        sw = (
            getattr(text, "sliding_window", None)
            if kind == "mistral"
            else getattr(at, "sliding_window", None)
        )
        windows.append(int(sw) - 1 if sw else -1)
        biases = [b if b is not None else empty for b in (bq, bk, bv)]
        weights += [ln_in, wq, wk, wv, *biases, *heads, wo, ln_post, wg, wu, wd]
        formats += ["", fq, fk, fv, "", "", "", "", "", fo, "", fg, fu, fd]
    odd = [
        t
        for t, f in zip(weights, formats, strict=True)
        if t.numel() and (t.dtype != (torch.uint8 if f else dtype) or not t.is_contiguous())
    ]
    if odd:
        raise Unsupported(f"{len(odd)} weight tensors are not contiguous {dtype} (or packed uint8)")
    k0 = kv_caches[0]
    if k0.dim() != 4:
        raise Unsupported(f"KV cache tensors are {k0.dim()}-D, expected 4-D")
    hkv, d = (k0.shape[1], k0.shape[3]) if cache_layout == "bhsd" else (k0.shape[2], k0.shape[3])
    hq = layers[0].self_attn.q_proj.out_features // d
    cos_sin = _rotary_table(base, text, max_positions, dtype)
    dims = [len(layers), hq, hkv, d, block_size, *windows]
    with torch.inference_mode():
        return torch.classes.topg.DecodePlan(
            weights, formats, list(kv_caches), cos_sin, dims, [eps, scale], cache_layout
        )


#: Names of the plan's profile phases (``TOPG_PROFILE=1``), in ``profile()`` order.
PHASES = ("norm+qkv+rotary+cache", "attention", "o_proj", "norm+gate_up+silu", "down",
          "norm+lm_head")  # fmt: skip


def profile(plan: Any) -> dict[str, Any]:
    """Seconds per phase (summed over the steps run with ``TOPG_PROFILE=1``) and steps."""
    *secs, steps = plan.profile()
    return {"steps": int(steps), "seconds": dict(zip(PHASES, secs, strict=True))}
