"""The decode step as one native call: lowering a model to ``topg.DecodePlan``.

The engine's decode batches (every sequence one new token) run on a plan built once
from the model's own tensors (``csrc/cpu/decode_plan.cpp``): one call per step, no
Python, no dispatcher, one team of threads for the whole step (docs/decode-step.md).
Prefill chunks, speculative verify steps and anything :func:`lower` refuses stay on the
compiled graph, and the reason is kept (``engine.stats()["decode_plan"]``).

What the plan computes is the decoder: token embedding (optionally scaled); per layer
an optional pre-norm, q / k / v projections (optional biases; QK-norm per head or over
the whole projection), neox rotary from the model's own rotary module (or none, per
layer; one table per layer type where the module takes one, Gemma 3), paged attention
(GQA, optional sliding window, optional logit softcap), o projection, an optional
post-norm, residual (optionally scaled); the same around a SiLU-, GELU- or
tanh-GELU-gated MLP or a sparse MoE block (:mod:`torch_topg.compile.decode_plan_moe`);
final RMSNorm and the LM head (optionally divided, optionally softcapped after the
call). Every norm applies ``w`` or (Gemma) ``1 + w`` in float32. The norms' roles are
measured (:mod:`torch_topg.compile.decode_plan_layer`), and so are their form, the
MLP's activation and an embedding's scale.
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


def _embedding(mod: Any, dtype: torch.dtype) -> tuple[torch.Tensor, str, float]:
    """(weight, format, scale): the rows and the factor the module multiplies them by, as
    one op in the model dtype (Gemma's ``sqrt(hidden)`` cast to the model dtype; 1: none).
    A subclass of ``nn.Embedding`` is measured: its output on a few ids must be the rows
    times that factor, bitwise."""
    from torch_topg.quant.modules import QuantizedEmbedding

    if type(mod) is QuantizedEmbedding:
        if mod.dtype_ref.dtype != dtype:
            raise Unsupported(f"embed_tokens returns {mod.dtype_ref.dtype}, the model is {dtype}")
        if mod.embed_scale is not None:
            raise Unsupported(f"embed_tokens scales its rows by {mod.embed_scale:g}")
        return mod.qweight, mod.format, 1.0
    if not isinstance(mod, torch.nn.Embedding) or mod.weight.dtype != dtype:
        raise Unsupported(f"embed_tokens is {type(mod).__name__}")
    if type(mod) is torch.nn.Embedding:
        return mod.weight, "", 1.0
    scale = getattr(mod, "embed_scale", 1.0)
    scale = float(scale.to(dtype)) if isinstance(scale, torch.Tensor) else float(scale)
    ids = torch.arange(min(mod.num_embeddings, 64))
    with torch.inference_mode():
        got = mod(ids)
        want = mod.weight[ids] * torch.tensor(scale, dtype=dtype)
    if got.dtype != dtype or not torch.equal(got, want):
        raise Unsupported(f"embed_tokens ({type(mod).__name__}) computes something other than "
                          f"its rows times {scale:g}")  # fmt: skip
    return mod.weight, "", scale


def _rms(mod: Any, name: str) -> tuple[torch.Tensor, float, int]:
    """(weight, epsilon, offset): offset 1 where the norm applies ``1 + w`` (Gemma's
    ``x * (1 + w.float())``), 0 where it applies ``w``: measured on a float32 probe input
    (both forms multiply the normalised rows in float32 there), not read from the name."""
    if not type(mod).__name__.endswith("RMSNorm"):
        raise Unsupported(f"{name} is {type(mod).__name__}, not an RMSNorm")
    eps = getattr(mod, "variance_epsilon", getattr(mod, "eps", None))
    w = getattr(mod, "weight", None)
    if eps is None or not isinstance(w, torch.Tensor) or w.dim() != 1:
        raise Unsupported(f"{name}: no weight / epsilon")
    x = torch.randn(1, 2, w.shape[0], generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        got = mod(x)
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + float(eps))
        forms = [y * w.float(), y * (1.0 + w.float())]
    hits = [i for i, f in enumerate(forms) if got.shape == f.shape and torch.allclose(got.float(), f, rtol=1e-5, atol=1e-6)]  # fmt: skip
    if len(hits) != 1:
        raise Unsupported(f"{name} ({type(mod).__name__}) is neither x * w nor x * (1 + w) "
                          "after the RMS normalisation")  # fmt: skip
    return w, float(eps), hits[0]


def _activation(mlp: Any, name: str) -> int:
    """The gated MLP's activation as the plan's kind (``moe::Act``: 0 SiLU, 1 GELU (erf),
    2 tanh GELU, Gemma's ``gelu_pytorch_tanh``), measured: ``act_fn`` on a probe input
    must equal one of torch's functions bitwise (the graph's gated-MLP pass then fuses it
    into the kernel the plan runs)."""
    act = getattr(mlp, "act_fn", None)
    if act is None:
        raise Unsupported(f"{name} has no act_fn")
    x = torch.linspace(-8, 8, 101)
    kinds = [torch.nn.functional.silu(x), torch.nn.functional.gelu(x),
             torch.nn.functional.gelu(x, approximate="tanh")]  # fmt: skip
    with torch.inference_mode():
        got = act(x)
    for kind, want in enumerate(kinds):
        if torch.equal(got, want):
            return kind
    raise Unsupported(f"{name}.act_fn ({type(act).__name__}) is not SiLU, GELU or tanh GELU")


def _rope_kinds(config: Any) -> list[str]:
    """The rope types of the configuration (one, or one per layer type: Gemma 3's
    ``rope_parameters`` is keyed by layer type)."""
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        return ["default"]
    nested = [v for v in rope.values() if isinstance(v, dict)]
    return [r.get("rope_type", r.get("type", "default")) for r in (nested or [rope])]


def _rotary_table(base: Any, config: Any, positions: int, dtype: torch.dtype,
                  layer_types: list[str | None]) -> torch.Tensor:  # fmt: skip
    """``[positions, head_dim]`` rows ``[cos_0..cos_{h-1}, sin_0..sin_{h-1}]`` computed by
    the model's own rotary module (its scaling included), in the dtype it returns them
    (the model dtype, or float32: OLMo 2's module does not round them), as the compiled
    graph's rotary pass takes them. With several ``layer_types`` (a module whose forward
    takes the layer type, Gemma 3's: local layers ``rope_local_base_freq``, global ones
    ``rope_theta`` and their scaling), ``[len(layer_types), positions, head_dim]``."""
    for kind in _rope_kinds(config):
        if kind in ("dynamic", "longrope"):
            raise Unsupported(f"rope_type {kind!r} changes its frequencies with the length")
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise Unsupported("partial rotary")
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None:
        raise Unsupported("no model.rotary_emb module")
    pos = torch.arange(positions, device="cpu")[None]
    x = torch.empty(1, dtype=dtype)
    tables = []
    for lt in layer_types:
        with torch.inference_mode():
            cos, sin = rotary(x, pos) if lt is None else rotary(x, pos, lt)
        half = cos.shape[-1] // 2
        if not (
            torch.equal(cos[..., :half], cos[..., half:])
            and torch.equal(sin[..., :half], sin[..., half:])
        ):
            raise Unsupported("rotary cos / sin halves differ (not neox-style)")
        out = torch.float32 if cos.dtype == torch.float32 else dtype
        tables.append(torch.cat([cos[0, :, :half], sin[0, :, :half]], -1).to(out))
    if len(tables) == 1:
        return tables[0].contiguous()
    return torch.stack(tables).contiguous()


def _rotary_types(base: Any, text: Any, n: int) -> list[str | None]:
    """Per layer, the layer type its rotary table is made for: None for every layer when
    the model's rotary module has one table; the config's ``layer_types`` when its
    forward takes a layer type (Gemma 3)."""
    import inspect

    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or "layer_type" not in inspect.signature(rotary.forward).parameters:
        return [None] * n
    types = list(getattr(text, "layer_types", None) or [])
    if len(types) < n:
        raise Unsupported(f"the rotary module takes a layer type; layer_types has {len(types)} "
                          f"entries for {n} layers")  # fmt: skip
    return types[:n]


#: Config attributes that change the decoder's arithmetic in ways the plan does not
#: compute, with the value that means "off" (the feature is named in the refusal).
_CONFIG_FEATURES: dict[str, tuple[str, Any]] = {
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
    from torch_topg.compile.decode_plan_moe import ACT_SHIFT, is_moe, lower_moe

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
    embed, embed_fmt, embed_scale = _embedding(base.embed_tokens, dtype)
    final_norm, eps, offset = _rms(base.norm, "model.norm")
    lm_head, _, head_fmt = _linear(model.lm_head, "lm_head", bias_ok=False)
    weights = [embed, final_norm, lm_head]
    formats = [embed_fmt, "", head_fmt]
    per_layer: list[int] = []
    scale = None
    empty = torch.empty(0, dtype=dtype)
    mults = _multipliers(text)
    if embed_scale != 1.0:  # Gemma's sqrt(hidden): the embedding multiplier's one op
        if mults[0] != 1.0:
            raise Unsupported("embed_tokens scales its rows and embedding_multiplier is set")
        mults[0] = embed_scale
    rotary = _rotary_layers(text, len(layers))
    types = _rotary_types(base, text, len(layers))
    tables = list(dict.fromkeys(types))  # a table per distinct layer type, first seen first
    rotary = [r and tables.index(t) + 1 for r, t in zip(rotary, types, strict=True)]
    softcap = None
    hidden = final_norm.shape[0]
    for i, layer in enumerate(layers):
        roles = _probe_layer(i, layer, hidden, mults[1])
        at, mlp = layer.self_attn, layer.mlp
        # pre-attention, pre-MLP, post-attention, post-MLP norms (absent: empty)
        norms = [
            _rms(getattr(layer, roles[r]), f"layers.{i}.{roles[r]}")
            if r in roles
            else (empty, eps, offset)
            for r in ("pre_attn", "pre_ffw", "post_attn", "post_ffw")
        ]
        if any(e != eps for _, e, _ in norms):
            raise Unsupported("RMSNorm epsilons differ between layers")
        if any(o != offset for _, _, o in norms):
            raise Unsupported("the model's RMSNorms apply w in some places, 1 + w in others")
        ln_in, ln_post, post_attn, post_ffw = (w for w, _, _ in norms)
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
            w, e, o = _rms(mod, f"layers.{i}.self_attn.{nm}")
            if e != eps or o != offset:
                raise Unsupported(f"layers.{i}.self_attn.{nm}: epsilon or 1 + w form differs "
                                  "from the layers'")  # fmt: skip
            heads.append(w)
        s = float(at.scaling)
        if scale is not None and s != scale:
            raise Unsupported("attention scaling differs between layers")
        scale = s
        # tanh(s / cap) * cap on the attention scores (Gemma 2): the module's, or the config's
        cap = getattr(at, "attn_logit_softcapping", getattr(text, "attn_logit_softcapping", None))
        cap = float(cap) if cap else 0.0
        if softcap is not None and cap != softcap:
            raise Unsupported("attention logit softcapping differs between layers")
        softcap = cap
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
        act = _activation(mlp, f"layers.{i}.mlp") << ACT_SHIFT
        weights += [wg, wu, wd] + [empty] * 7 + [post_attn, post_ffw]
        formats += [fg, fu, fd] + [""] * 9
        per_layer += [int(sw) - 1 if sw else -1, 0, act, rotary[i]]
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
    cos_sin = _rotary_table(base, text, max_positions, dtype, tables)
    dims = [len(layers), hq, hkv, d, block_size, *per_layer]
    params = [eps, scale, *mults, softcap or 0.0, float(offset)]
    with torch.inference_mode():
        plan = torch.classes.topg.DecodePlan(
            weights, formats, list(kv_caches), cos_sin, dims, params, cache_layout
        )
    cap = getattr(text, "final_logit_softcapping", None)
    return _CappedLogits(plan, float(cap), dtype) if cap else plan


class _CappedLogits:
    """A plan whose model caps its logits, ``tanh(logits / cap) * cap`` (Gemma 2's
    ``final_logit_softcapping``): the three ops run after the native call on its
    ``[rows, vocab]`` logits, as the same torch ops in the model dtype that the graph runs
    (ATen's vectorised tanh, which the plan's kernels do not copy: computed there, the
    logits would differ from the graph's in the last bits). Everything else is the plan's."""

    def __init__(self, plan: Any, cap: float, dtype: torch.dtype) -> None:
        self._plan, self._cap, self._dtype = plan, cap, dtype

    def run(self, *args: torch.Tensor) -> torch.Tensor:
        logits = self._plan.run(*args).to(self._dtype)  # the LM head's values, exactly
        return (torch.tanh(logits / self._cap) * self._cap).float()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


#: Names of the plan's profile phases (``TOPG_PROFILE=1``), in ``profile()`` order.
PHASES = ("norm+qkv+rotary+cache", "attention", "o_proj", "norm+gate_up+silu (MoE: +router)",
          "experts_gate_up", "down", "norm+lm_head")  # fmt: skip


def profile(plan: Any) -> dict[str, Any]:
    """Seconds per phase (summed over the steps run with ``TOPG_PROFILE=1``) and steps."""
    *secs, steps = plan.profile()
    return {"steps": int(steps), "seconds": dict(zip(PHASES, secs, strict=True))}
