"""The decode step as one native call: lowering a model to ``topg.DecodePlan``.

The engine's decode batches (every sequence one new token) run on a plan built once
from the model's own tensors (``csrc/cpu/decode_plan.cpp``): one call per step, no
Python, no dispatcher, one team of threads for the whole step (docs/decode-step.md).
Prefill chunks, speculative verify steps and anything :func:`lower` refuses stay on the
compiled graph, and the reason is kept (``engine.stats()["decode_plan"]``).

What the plan computes is the decoder: token embedding (optionally scaled); per layer
an optional pre-norm, q / k / v projections (optional biases; QK-norm per head or over
the whole projection), neox rotary from the model's own rotary module (or none, per
layer), paged attention (GQA, optional sliding window), o projection, an optional
post-norm, residual (optionally scaled); the same around a SiLU-gated MLP or a sparse
MoE block (:mod:`torch_topg.compile.decode_plan_moe`); final RMSNorm and the LM head
(optionally divided). The norms' roles are measured
(:mod:`torch_topg.compile.decode_plan_layer`).
:func:`lower` probes a model (configuration features, modules, the router's measured
semantics; no list of families) and otherwise says what differs. Projections, experts,
the LM head and the embedding may be quantised (``torch_topg.quantize``,
``quantization="gguf"``): the plan multiplies packed rows with ``linear_q``'s and
``fused_moe_q``'s kernels.

It lives below the engine because two callers lower models: the engine's model runner
and the compile backend's static-cache decode (:mod:`torch_topg.compile.static_plan`).
"""

from __future__ import annotations

from typing import Any

import torch

from torch_topg.compile.plan_errors import StalePlan, Unsupported

__all__ = ["StalePlan", "Unsupported", "lower", "run"]


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
    the model's own rotary module (its scaling included), in the dtype it returns them
    (the model dtype, or float32: OLMo 2's module does not round them), as the compiled
    graph's rotary pass takes them."""
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
    out = torch.float32 if cos.dtype == torch.float32 else dtype
    return torch.cat([cos[0, :, :half], sin[0, :, :half]], -1).to(out).contiguous()


#: Config attributes that change the decoder's arithmetic in ways the plan does not
#: compute, with the value that means "off" (the feature is named in the refusal).
_CONFIG_FEATURES: dict[str, tuple[str, Any]] = {
    "attn_logit_softcapping": ("attention logit softcapping", None),
    "final_logit_softcapping": ("final logit softcapping", None),
    "clip_qkv": ("q / k / v clipping (clip_qkv)", None),
    "scale_emb": ("an embedding scale (scale_emb)", 1),
    "scale_depth": ("a residual scale (scale_depth)", None),
    "router_jitter_noise": (None, None),  # training only
}

#: Granite's multipliers, computed by the plan (each an op of the graph rounded to the
#: model dtype): config key -> value meaning "none".
_MULTIPLIERS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0}

#: The children of a decoder layer the plan computes (besides at most four RMSNorms, whose
#: roles :func:`~torch_topg.compile.decode_plan_layer.norm_roles` measures) and of its
#: attention.
_LAYER_CHILDREN = {"self_attn", "mlp"}
_ATTN_CHILDREN = {"q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"}


def _probe_config(text: Any) -> None:
    """Refuses a configuration whose decoder computes something the plan does not."""
    for key, (what, off) in _CONFIG_FEATURES.items():
        v = getattr(text, key, off)
        if what is not None and v is not None and v != off:
            raise Unsupported(f"{what} ({key}={v!r})")
    act = getattr(text, "hidden_act", None) or getattr(text, "hidden_activation", None) or "silu"
    if act not in ("silu", "swish"):
        raise Unsupported(f"hidden_act {act!r} (the plan's MLP is SiLU-gated)")


def _multipliers(text: Any) -> list[float]:
    """[embedding, residual, logits divisor] (Granite's; 1.0 where the config has none)."""
    out = []
    for key, off in _MULTIPLIERS.items():
        v = getattr(text, key, off)
        out.append(off if v is None else float(v))
    return out


def _rotary_layers(text: Any, n: int) -> list[int]:
    """Per layer 1 if its q / k are rotated, 0 if not (SmolLM3's ``no_rope_layers``: a
    true entry means the layer uses rotary)."""
    no_rope = getattr(text, "no_rope_layers", None)
    if not no_rope:
        return [1] * n
    if len(no_rope) < n:
        raise Unsupported(f"no_rope_layers has {len(no_rope)} entries for {n} layers")
    return [1 if no_rope[i] else 0 for i in range(n)]


def _probe_layer(i: int, layer: Any, hidden: int, resid_mult: float) -> dict[str, str]:
    """The layer's norms by role (:data:`~torch_topg.compile.decode_plan_layer.ROLES`)."""
    from torch_topg.compile.decode_plan_layer import norm_roles

    names = [n for n, _ in layer.named_children()]
    missing = sorted(_LAYER_CHILDREN - set(names))
    norms = [n for n in names if n not in _LAYER_CHILDREN]
    odd = [n for n in norms if not type(getattr(layer, n)).__name__.endswith("RMSNorm")]
    if missing or odd or len(norms) > 4:
        raise Unsupported(f"layers.{i} has {sorted(names)}: expected self_attn, mlp and at "
                          "most four RMSNorms")  # fmt: skip
    at = layer.self_attn
    odd = sorted(n for n, _ in at.named_children() if n not in _ATTN_CHILDREN)
    if odd:
        raise Unsupported(f"layers.{i}.self_attn has {odd}")
    for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(at, n):
            raise Unsupported(f"layers.{i}.self_attn has no {n} (fused projections)")
    if isinstance(getattr(at, "sinks", None), torch.Tensor):  # the plan has no sink term
        raise Unsupported(f"layers.{i}.self_attn.sinks (attention sinks)")
    return norm_roles(layer, f"layers.{i}", norms, hidden, resid_mult)


def lower(model: torch.nn.Module, kv_caches: list[torch.Tensor], *, block_size: int,
          max_positions: int, cache_layout: str = "paged") -> Any:  # fmt: skip
    """A ``torch.classes.topg.DecodePlan`` for ``model`` over ``kv_caches`` (``[K, V]`` per
    layer); raises :class:`Unsupported` naming what does not fit.

    There is no list of families: the model is probed (its configuration's features,
    each layer's modules, an MoE block's router measured on a probe input) and a feature
    the plan lacks is named in the refusal.

    ``cache_layout``: ``"paged"`` (the engine's ``[blocks, block_size, kv_heads, head_dim]``)
    or ``"bhsd"`` (transformers' ``StaticCache``, ``[batch, kv_heads, max_len, head_dim]``:
    each batch row is one block of ``block_size = max_len``).

    The plan holds the parameters themselves (not copies): updates of their values are
    seen at the next step, and a parameter converted or moved through ``.data`` (e.g.
    ``model.to(dtype)``) makes ``run`` refuse as stale, after which the runner lowers
    again. A parameter *object* replaced on its module is not seen: call
    ``ModelRunner.relower()`` after that."""
    from torch_topg import _native
    from torch_topg.compile.decode_plan_moe import is_moe, lower_moe

    if not _native.load() or not hasattr(torch.classes.topg, "DecodePlan"):
        raise Unsupported(f"native library not loaded ({_native.missing_reason('cpu')})")
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if base is None or layers is None or not hasattr(model, "lm_head"):
        raise Unsupported("not a <Model>ForCausalLM with .model.layers and .lm_head")
    p = base.norm.weight if hasattr(base, "norm") else next(model.parameters())
    if p.device.type != "cpu":
        raise Unsupported(
            f"device {p.device.type}: the plan runs on the CPU (CUDA: CUDA graphs, not yet)"
        )
    dtype = p.dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise Unsupported(f"dtype {dtype}")
    if any(t.dtype != dtype for t in kv_caches):
        raise Unsupported("KV cache dtype differs from the model's (int8 KV cache)")
    _probe_config(text)
    if len(kv_caches) != 2 * len(layers):
        raise Unsupported(f"{len(kv_caches)} KV tensors for {len(layers)} layers")
    embed, embed_fmt = _embedding(base.embed_tokens, dtype)
    final_norm, eps = _rms(base.norm, "model.norm")
    lm_head, _, head_fmt = _linear(model.lm_head, "lm_head", bias_ok=False)
    weights = [embed, final_norm, lm_head]
    formats = [embed_fmt, "", head_fmt]
    per_layer: list[int] = []
    scale = None
    empty = torch.empty(0, dtype=dtype)
    mults = _multipliers(text)
    rotary = _rotary_layers(text, len(layers))
    hidden = final_norm.shape[0]
    for i, layer in enumerate(layers):
        roles = _probe_layer(i, layer, hidden, mults[1])
        at, mlp = layer.self_attn, layer.mlp
        # pre-attention, pre-MLP, post-attention, post-MLP norms (absent: empty)
        ln_in, ln_post, post_attn, post_ffw = (
            _rms(getattr(layer, roles[r]), f"layers.{i}.{roles[r]}") if r in roles else (empty, eps)
            for r in ("pre_attn", "pre_ffw", "post_attn", "post_ffw")
        )
        if any(e != eps for e in (ln_in[1], ln_post[1], post_attn[1], post_ffw[1])):
            raise Unsupported("RMSNorm epsilons differ between layers")
        ln_in, ln_post, post_attn, post_ffw = ln_in[0], ln_post[0], post_attn[0], post_ffw[0]
        wq, bq, fq = _linear(at.q_proj, f"layers.{i}.self_attn.q_proj", True)
        wk, bk, fk = _linear(at.k_proj, f"layers.{i}.self_attn.k_proj", True)
        wv, bv, fv = _linear(at.v_proj, f"layers.{i}.self_attn.v_proj", True)
        wo, _, fo = _linear(at.o_proj, f"layers.{i}.self_attn.o_proj", False)
        heads = []
        for nm in ("q_norm", "k_norm"):  # per head (Qwen3) or the whole projection (OLMoE)
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
        # The window transformers passes to the attention function: the module's own
        # (Qwen2 / Qwen3: None on full-attention layers) or else the config's (Mistral).
        sw = getattr(at, "sliding_window", getattr(text, "sliding_window", None))
        biases = [b if b is not None else empty for b in (bq, bk, bv)]
        weights += [ln_in, wq, wk, wv, *biases, *heads, wo, ln_post]
        formats += ["", fq, fk, fv, "", "", "", "", "", fo, ""]
        if is_moe(mlp):
            w_moe, f_moe, dims = lower_moe(mlp, f"layers.{i}.mlp", dtype, _linear)
            weights += [*w_moe, post_attn, post_ffw]
            formats += [*f_moe, "", ""]
            per_layer += [int(sw) - 1 if sw else -1, *dims, rotary[i]]
            continue
        odd = sorted(n for n, _ in mlp.named_children()
                     if n not in ("gate_proj", "up_proj", "down_proj", "act_fn"))  # fmt: skip
        if odd:
            raise Unsupported(f"layers.{i}.mlp has {odd}")
        wg, _, fg = _linear(mlp.gate_proj, f"layers.{i}.mlp.gate_proj", False)
        wu, _, fu = _linear(mlp.up_proj, f"layers.{i}.mlp.up_proj", False)
        wd, _, fd = _linear(mlp.down_proj, f"layers.{i}.mlp.down_proj", False)
        weights += [wg, wu, wd] + [empty] * 7 + [post_attn, post_ffw]
        formats += [fg, fu, fd] + [""] * 9
        per_layer += [int(sw) - 1 if sw else -1, 0, 0, rotary[i]]
    odd_t = [
        t
        for t, f in zip(weights, formats, strict=True)
        if t.numel() and (t.dtype != (torch.uint8 if f else dtype) or not t.is_contiguous())
    ]
    if odd_t:
        raise Unsupported(
            f"{len(odd_t)} weight tensors are not contiguous {dtype} (or packed uint8)"
        )
    k0 = kv_caches[0]
    if k0.dim() != 4:
        raise Unsupported(f"KV cache tensors are {k0.dim()}-D, expected 4-D")
    hkv, d = (k0.shape[1], k0.shape[3]) if cache_layout == "bhsd" else (k0.shape[2], k0.shape[3])
    hq = layers[0].self_attn.q_proj.out_features // d
    cos_sin = _rotary_table(base, text, max_positions, dtype)
    dims = [len(layers), hq, hkv, d, block_size, *per_layer]
    with torch.inference_mode():
        return torch.classes.topg.DecodePlan(
            weights, formats, list(kv_caches), cos_sin, dims, [eps, scale, *mults], cache_layout
        )


#: Names of the plan's profile phases (``TOPG_PROFILE=1``), in ``profile()`` order.
PHASES = ("norm+qkv+rotary+cache", "attention", "o_proj", "norm+gate_up+silu (MoE: +router)",
          "experts_gate_up", "down", "norm+lm_head")  # fmt: skip


def profile(plan: Any) -> dict[str, Any]:
    """Seconds per phase (summed over the steps run with ``TOPG_PROFILE=1``) and steps."""
    *secs, steps = plan.profile()
    return {"steps": int(steps), "seconds": dict(zip(PHASES, secs, strict=True))}
