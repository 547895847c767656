"""The topg versions of vLLM's layers (imported by ``vllm_plugin.register()`` only).

Each topg layer is a subclass of the vLLM class it replaces, built as
``Topg<Name>(<family mixin>, <vLLM class>)``: construction, weights, ``forward_native``
and every ``forward_<platform>`` stay vLLM's. The mixin changes which forward runs:
:meth:`_TopgOp.dispatch_forward` picks ``_topg_forward``, which calls topg when
``_topg_check`` finds nothing it does not cover, else the ``forward_<platform>`` vLLM
would have picked (the reason is logged once, see ``vllm_mode.log_fallback``).
vLLM modules are imported per family; one that fails to import is recorded in
``skipped`` with the module and the error, and the other families still register.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torch_topg import _native
from torch_topg import ops as topg
from torch_topg.integrations import vllm_mode

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
_OPS = (
    "rms_norm",
    "fused_add_rms_norm",
    "silu_and_mul",
    "gelu_and_mul",
    "rotary_embedding",
    "fused_moe",
)
_kernel_reasons: dict[tuple[str, str], str | None] = {}


def _kernel_reason(op: str, t: torch.Tensor) -> str | None:
    """Why topg cannot run ``op`` on ``t``'s device (None: a native kernel is there).

    A lookup in a table filled at registration (``_fill_kernel_reasons``): no dispatcher
    query on the hot path, and nothing dynamo cannot trace when vLLM compiles the model.
    """
    key = _DEVICE_KEYS.get(t.device.type)
    if key is None:
        return f"tensors on '{t.device.type}' (topg has CPU and CUDA kernels)"
    return _kernel_reasons.get((op, key), f"topg::{op} is not a topg op")


def _fill_kernel_reasons() -> None:
    for op in _OPS:
        for device, key in _DEVICE_KEYS.items():
            reason = None
            if not _native.is_loaded() or not _native.has_kernel(op, key):
                reason = f"no native topg kernel for {key}: {_native.missing_reason(device)}"
            _kernel_reasons[(op, key)] = reason


def _dtype_reason(name: str, t: torch.Tensor) -> str | None:
    if t.dtype not in _DTYPES:
        return f"{name} dtype {t.dtype} (topg: float32, bfloat16, float16)"
    return None


def _platform_forward(op: Any) -> Callable[..., Any]:
    """The ``forward_<platform>`` vLLM's ``CustomOp.dispatch_forward`` picks when enabled."""
    from vllm.platforms import current_platform as p

    if p.is_rocm():
        return op.forward_hip
    if p.is_cpu():
        return op.forward_cpu
    if p.is_tpu():
        return op.forward_tpu
    if p.is_xpu():
        return op.forward_xpu
    if p.is_out_of_tree():
        return op.forward_oot
    return op.forward_cuda


class _TopgOp:
    """Mixin placed before a vLLM ``CustomOp`` subclass (see the module docstring)."""

    _topg_base: type  # the vLLM class this one replaces (set by _register)

    def dispatch_forward(self, compile_native: bool = False) -> Callable[..., Any]:
        from vllm.config import get_cached_compilation_config

        base = self._topg_base
        # The in-tree name ("rms_norm"): register_oot renamed this class to "RMSNorm",
        # and users choose ops with custom_ops=["+rms_norm"].
        enabled = bool(getattr(self, "_enforce_enable", False)) or base.enabled()
        config = get_cached_compilation_config()
        (config.enabled_custom_ops if enabled else config.disabled_custom_ops).update([base.name])
        if enabled:
            self._topg_vllm_forward = _platform_forward(self)
            return self._topg_forward
        # Disabled: vLLM would run forward_native (compiled inside opaque custom ops).
        native = self.maybe_compile(self.forward_native, enable=compile_native)
        if vllm_mode.mode() != "all":
            return native
        self._topg_vllm_forward = native
        return self._topg_forward

    def _topg_forward(self, *args: Any, **kwargs: Any) -> Any:
        reason = self._topg_check(*args, **kwargs)
        if reason is None:
            return self._topg_run(*args, **kwargs)
        if not torch.compiler.is_compiling():
            vllm_mode.log_fallback(self._topg_base.__name__, reason)
        return self._topg_vllm_forward(*args, **kwargs)

    def _topg_check(self, *args: Any, **kwargs: Any) -> str | None:
        raise NotImplementedError

    def _topg_run(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


# --- RMSNorm -------------------------------------------------------------------------


class _RMSNormTopg(_TopgOp):
    """``RMSNorm``: ``topg.rms_norm``; with ``residual`` ``topg.fused_add_rms_norm`` in
    place on ``x`` and ``residual`` (as vLLM's CUDA kernel), returning ``(x, residual)``."""

    def _topg_check(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> str | None:
        from vllm import envs

        if envs.VLLM_BATCH_INVARIANT:
            return "VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant kernel)"
        if self.variance_size_override is not None:
            return f"var_hidden_size={self.variance_size_override} (variance over part of the hidden size)"
        w = self.weight.data
        if reason := _dtype_reason("input", x):
            return reason
        if w.dtype not in (x.dtype, torch.float32):
            return f"weight dtype {w.dtype} with input dtype {x.dtype}"
        if w.device != x.device or w.dim() != 1 or w.shape[0] != x.shape[-1]:
            return f"weight {tuple(w.shape)} on {w.device} for input {tuple(x.shape)} on {x.device}"
        if residual is None:
            return _kernel_reason("rms_norm", x)
        if residual.shape != x.shape or residual.dtype != x.dtype:
            return f"residual {tuple(residual.shape)} {residual.dtype} for input {tuple(x.shape)} {x.dtype}"
        if not (x.is_contiguous() and residual.is_contiguous()):
            return "non-contiguous input or residual (both are updated in place)"
        return _kernel_reason("fused_add_rms_norm", x)

    def _topg_run(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return topg.rms_norm(x, self.weight.data, self.variance_epsilon)
        topg.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)
        return x, residual


# --- gated activations -------------------------------------------------------------


def _gated_reason(op: str, x: torch.Tensor) -> str | None:
    if reason := _dtype_reason("input", x):
        return reason
    if x.dim() == 0 or x.shape[-1] % 2:
        return f"input {tuple(x.shape)} (an even last dimension: gate | up)"
    return _kernel_reason(op, x)


class _SiluAndMulTopg(_TopgOp):
    """``SiluAndMul``: ``topg.silu_and_mul``."""

    def _topg_check(self, x: torch.Tensor) -> str | None:
        return _gated_reason("silu_and_mul", x)

    def _topg_run(self, x: torch.Tensor) -> torch.Tensor:
        return topg.silu_and_mul(x)


class _GeluAndMulTopg(_TopgOp):
    """``GeluAndMul``: ``topg.gelu_and_mul`` (exact or tanh GELU)."""

    def _topg_check(self, x: torch.Tensor) -> str | None:
        if self.approximate not in ("none", "tanh"):
            return f"approximate={self.approximate!r}"
        return _gated_reason("gelu_and_mul", x)

    def _topg_run(self, x: torch.Tensor) -> torch.Tensor:
        return topg.gelu_and_mul(x, self.approximate)


# --- rotary embedding --------------------------------------------------------------


def _token_view(t: torch.Tensor, tokens: int) -> torch.Tensor | None:
    """``t`` as ``[tokens, width]`` sharing its storage (rotated in place), or None."""
    if tokens == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(tokens, -1)
    except RuntimeError:
        return None


class _RotaryTopg(_TopgOp):
    """``RotaryEmbedding`` (and subclasses that only change its cos/sin table):
    ``topg.rotary_embedding`` in place on ``query`` / ``key``, as vLLM's CUDA kernel."""

    def _topg_check(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> str | None:
        if getattr(self, "use_flashinfer", False) or getattr(self, "use_aiter", False):
            return "vLLM chose its FlashInfer / AITER rotary kernel"
        if reason := _dtype_reason("query", query):
            return reason
        if key is not None and key.dtype != query.dtype:
            return f"key dtype {key.dtype} with query dtype {query.dtype}"
        if self.rotary_dim % 2 or not 2 <= self.rotary_dim <= self.head_size:
            return f"rotary_dim={self.rotary_dim} with head_size={self.head_size}"
        tokens = positions.numel()
        for name, t in (("query", query), ("key", key)):
            if t is None:
                continue
            view = _token_view(t, tokens)
            if view is None or view.shape[1] % self.head_size:
                return f"{name} {tuple(t.shape)} is not a [tokens, heads * head_size] view"
        return _kernel_reason("rotary_embedding", query)

    def _topg_run(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        cache = self._match_cos_sin_cache_dtype(query)  # vLLM's own table, query's dtype
        flat = positions.reshape(-1)
        q = query.view(flat.numel(), -1)
        k = None if key is None else key.view(flat.numel(), -1)
        topg.rotary_embedding(flat, q, k, self.head_size, cache, self.is_neox_style)
        return query, key


# Methods whose override means a subclass rotates differently from RotaryEmbedding.
_ROTARY_METHODS = frozenset(
    {"forward", "forward_static", "_match_cos_sin_cache_dtype"}
    | {f"forward_{p}" for p in ("native", "cuda", "cpu", "hip", "xpu", "tpu", "oot")}
)


def _rotary_targets(base: type, skipped: dict[str, str]) -> Iterator[type]:
    """``base`` and its vLLM subclasses that only change the cos/sin table."""
    yield base
    todo = list(base.__subclasses__())
    while todo:
        cls = todo.pop()
        todo.extend(cls.__subclasses__())
        if not cls.__module__.startswith("vllm."):  # another plugin's subclass
            continue
        own = cls.__mro__[: cls.__mro__.index(base)]
        overridden = sorted({m for c in own for m in vars(c) if m in _ROTARY_METHODS})
        if overridden:
            skipped[cls.__name__] = f"overrides {', '.join(overridden)} (its own rotation)"
        else:
            yield cls


# --- fused MoE experts ---------------------------------------------------------------

_MOE_ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


class _UnquantizedMoETopg(_TopgOp):
    """``UnquantizedFusedMoEMethod`` (experts of an unquantised ``FusedMoE`` layer):
    ``topg.fused_moe`` on ``w13_weight [E, 2I, H]`` (gate rows first) and ``w2_weight
    [E, H, I]`` with the router's ``topk_weights`` / ``topk_ids`` (an id outside ``[0, E)``
    marks a padding row: it contributes nothing, as in vLLM's kernels)."""

    def _topg_check(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> str | None:
        moe = self.moe
        activation = getattr(layer.activation, "value", layer.activation)
        if activation not in _MOE_ACTIVATIONS:
            return f"activation {activation!r} (topg: silu, gelu, gelu_tanh)"
        if shared_experts is not None:
            return "shared experts (vLLM runs them beside the routed experts)"
        for what, why in (
            (layer.apply_router_weight_on_input, "apply_router_weight_on_input=True"),
            (layer.expert_map is not None, "expert parallelism (expert_map)"),
            (moe.has_bias, "expert biases"),
            (moe.is_lora_enabled, "LoRA"),
            (getattr(moe, "swiglu_limit", None) is not None, "a SwiGLU clamp limit"),
            (getattr(moe, "swiglu_alpha", None) is not None, "SwiGLU alpha / beta"),
        ):
            if what:
                return why
        if reason := _dtype_reason("hidden_states", x):
            return reason
        w13, w2 = layer.w13_weight, layer.w2_weight
        hidden = x.shape[1] if x.dim() == 2 else -1
        experts = w13.shape[0] if w13.dim() == 3 else -1
        if not (
            hidden > 0
            and w13.dim() == 3
            and w13.shape[2] == hidden
            and w13.shape[1] % 2 == 0
            and tuple(w2.shape) == (experts, hidden, w13.shape[1] // 2)
            and w13.dtype == w2.dtype == x.dtype
            and w13.is_contiguous()
            and w2.is_contiguous()
        ):
            return (
                f"weights w13 {tuple(w13.shape)} {w13.dtype}, w2 {tuple(w2.shape)} {w2.dtype} for "
                f"hidden_states {tuple(x.shape)} {x.dtype} (not [E, 2I, H] / [E, H, I]: "
                f"the {self.unquantized_backend.value} backend's layout?)"
            )
        if layer.global_num_experts not in (-1, experts):
            return f"global_num_experts={layer.global_num_experts} with {experts} local experts"
        if topk_ids.dtype not in (torch.int32, torch.int64):
            return f"topk_ids dtype {topk_ids.dtype}"
        if topk_weights.dtype not in (torch.float32, x.dtype):
            return f"topk_weights dtype {topk_weights.dtype}"
        return _kernel_reason("fused_moe", x)

    def _topg_run(
        self,
        layer: Any,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        activation = _MOE_ACTIVATIONS[getattr(layer.activation, "value", layer.activation)]
        # Padding rows (VLLM_MOE_SKIP_PADDING, on by default) come with id -1 and older
        # routers mark them with id E: such a slot contributes nothing.
        unrouted = (topk_ids < 0) | (topk_ids >= layer.w13_weight.shape[0])
        ids = topk_ids.masked_fill(unrouted, 0)
        weights = topk_weights.masked_fill(unrouted, 0)
        return topg.fused_moe(
            x, layer.w13_weight, layer.w2_weight, weights, ids, activation=activation
        )


# --- registration --------------------------------------------------------------------

# (vLLM module, class name, mixin); RotaryEmbedding also brings its plain subclasses.
FAMILIES: tuple[tuple[str, str, type[_TopgOp]], ...] = (
    ("vllm.model_executor.layers.layernorm", "RMSNorm", _RMSNormTopg),
    ("vllm.model_executor.layers.activation", "SiluAndMul", _SiluAndMulTopg),
    ("vllm.model_executor.layers.activation", "GeluAndMul", _GeluAndMulTopg),
    ("vllm.model_executor.layers.rotary_embedding", "RotaryEmbedding", _RotaryTopg),
    (
        "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method",
        "UnquantizedFusedMoEMethod",
        _UnquantizedMoETopg,
    ),
)


def _register(base: type, mixin: type, registered: dict[str, str], skipped: dict[str, str]) -> None:
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    name = base.__name__
    current = op_registry_oot.get(name)
    if current is not None:
        if getattr(current, "_topg_base", None) is base:  # registered by an earlier call
            registered[name] = current.__qualname__
        else:
            skipped[name] = f"already replaced by {current.__module__}.{current.__qualname__}"
        return
    cls = type(
        f"Topg{name}",
        (mixin, base),
        {"__module__": __name__, "__doc__": mixin.__doc__, "_topg_base": base},
    )
    CustomOp.register_oot(cls, name=name)
    registered[name] = cls.__qualname__
    skipped.pop(name, None)


def register_all(registered: dict[str, str], skipped: dict[str, str]) -> None:
    """Register every family whose vLLM module imports (see ``FAMILIES``)."""
    _fill_kernel_reasons()
    for module, class_name, mixin in FAMILIES:
        try:
            base = getattr(importlib.import_module(module), class_name)
        except Exception as exc:  # a vLLM build without this module or its dependencies
            skipped[f"{module}.{class_name}"] = (
                f"cannot import {module}: {type(exc).__name__}: {exc}"
            )
            continue
        targets = _rotary_targets(base, skipped) if mixin is _RotaryTopg else [base]
        for target in targets:
            _register(target, mixin, registered, skipped)
