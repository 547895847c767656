"""The implementations an op may run on CUDA, each with the exact semantics of the op's
reference (``torch_topg.reference``), within rounding.

A :class:`Candidate` says whether it exists in this process (``available``), whether it
can take a call (``supports``: None, or the reason it cannot) and runs it (``run``).
``supports`` looks only at what the call's shape class and feature key capture
(``classes.py``), so its answer can be cached per (op, class, features).

Candidates per op (:func:`candidates`):

* ``topg``: topg's own CUDA kernel, the internal op ``topg::_cuda_<op>``.
* ``attention``: ``sdpa_flash``, ``sdpa_cudnn``, ``sdpa_efficient`` (torch's SDPA with
  one backend forced, ``enable_gqa``): dense, no window, no softcap, no mask, causal only
  where top-left and bottom-right alignment agree (``Sq == Sk``).
* ``paged_attention``: ``triton`` (``torch_topg.triton_kernels.paged_attention``).
* ``fused_moe``: ``grouped_mm`` (tokens sorted by expert, ``torch._grouped_mm``),
  ``expert_loop`` (one GEMM pair per expert that was hit; reads the routing on the host,
  so not while a CUDA graph is captured), ``triton`` (``torch_topg.triton_kernels.fused_moe``).
* ``linear``: ``torch_linear`` (``aten::linear``: cuBLAS on CUDA).
* ``reference``: the op's fallback (argument checks, a once-per-device warning, the
  reference): always available, always last.

torch's kernels are called through ``OpOverload.decompose`` (the CompositeImplicitAutograd
kernel of ``aten::scaled_dot_product_attention`` / ``aten::linear``), below the CUDA key
where ``torch_topg.enable()`` routes those aten ops back to topg: a call from here never
comes back to the dispatch.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_topg import _native
from torch_topg.ops._registry import OPS
from torch_topg.ops._schemas import cuda_kernel_op
from torch_topg.reference.fused_moe import ACTIVATIONS

Supports = Callable[..., "str | None"]


def _always(*args: Any, **kwargs: Any) -> str | None:
    return None


def _present() -> str | None:
    return None


@dataclass(frozen=True)
class Candidate:
    """One implementation of ``op``.

    Attributes:
        name: unique within the op (``"topg"``, ``"sdpa_flash"``, ...); the table and the
            report use it.
        op: the ``topg`` op it implements.
        run: ``run(*args, **kwargs)`` with the op's arguments; ``tunable`` candidates also
            take ``config=`` (a dict from the table, or None for their defaults).
        supports: ``supports(*args, **kwargs)`` -> None, or a short reason it cannot take
            the call (``"softcap"``, ``"dtype float32"``, ...).
        available: ``available()`` -> None, or why it does not exist in this process (a
            module or kernel missing); evaluated once.
        tunable: takes ``config=`` (Triton kernels: block sizes, warps, stages).
    """

    name: str
    op: str
    run: Callable[..., Any]
    supports: Supports = _always
    available: Callable[[], str | None] = _present
    tunable: bool = False
    _state: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def unavailable(self) -> str | None:
        """``available()``, asked once and remembered."""
        if "why" not in self._state:
            try:
                self._state["why"] = self.available()
            except Exception as exc:  # a broken optional module must not break the op
                self._state["why"] = f"{type(exc).__name__}: {exc}"
        return self._state["why"]


def _first_tensor(args: tuple[Any, ...]) -> torch.Tensor:
    return next(a for a in args if isinstance(a, torch.Tensor))


def _on_cuda(*args: Any, **kwargs: Any) -> str | None:
    t = _first_tensor(args)
    return None if t.device.type == "cuda" else f"device {t.device.type} (a CUDA kernel)"


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


# --- topg's own kernel ------------------------------------------------------------------


def topg_candidate(op: str) -> Candidate:
    """``topg::_cuda_<op>``: topg's CUDA kernel of ``op`` (csrc/cuda)."""
    internal = cuda_kernel_op(op)

    def available() -> str | None:
        if _native.has_kernel(internal, "CUDA"):
            return None
        return f"no native kernel topg::{internal} ({_native.missing_reason('cuda')})"

    def run(*args: Any, **kwargs: Any) -> Any:
        return getattr(torch.ops.topg, internal).default(*args, **kwargs)

    return Candidate("topg", op, run, _on_cuda, available)


def reference_candidate(op: str) -> Candidate:
    """The op's fallback: checks, a once-per-device warning, the reference."""
    return Candidate("reference", op, lambda *a, **k: OPS[op].fallback(*a, **k))


# --- attention: torch's SDPA backends ----------------------------------------------------

#: candidate name -> (SDPBackend member name, the ``torch.backends.cuda`` check).
SDPA_BACKENDS: dict[str, tuple[str, str]] = {
    "sdpa_flash": ("FLASH_ATTENTION", "can_use_flash_attention"),
    "sdpa_cudnn": ("CUDNN_ATTENTION", "can_use_cudnn_attention"),
    "sdpa_efficient": ("EFFICIENT_ATTENTION", "can_use_efficient_attention"),
}


def _sdpa_static(name: str, q: torch.Tensor, k: torch.Tensor, kw: dict[str, Any]) -> str | None:
    """What SDPA (any backend) cannot express of ``topg::attention``, then the backend's
    own dtype / head-dim / GQA limits."""
    if kw.get("cu_seqlens_q") is not None:
        return "varlen (cu_seqlens)"
    if kw.get("softcap", 0.0) > 0:
        return "softcap"
    if kw.get("sinks") is not None:
        return "attention sinks (SDPA has no sink logit)"
    if kw.get("window_left", -1) >= 0:
        return "sliding window"
    if kw.get("mask") is not None:
        return "mask (a row that sees no key: SDPA gives NaN, topg zeros)"
    if q.dim() != 4 or k.dim() != 4:
        return "not [B, S, H, D]"
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if b == 0 or sq == 0 or sk == 0 or hq == 0 or d == 0:
        return "empty input"
    if kw.get("causal", False) and sq != sk:
        return "causal with Sq != Sk (SDPA's is_causal is top-left aligned, topg's bottom-right)"
    half = q.dtype in (torch.float16, torch.bfloat16)
    if name in ("sdpa_flash", "sdpa_cudnn") and not half:
        return f"dtype {dtype_name(q.dtype)} (fp16 / bf16 only)"
    if name == "sdpa_flash" and (d > 256 or d % 8):
        return f"head_dim {d} (flash: a multiple of 8, at most 256)"
    if name == "sdpa_cudnn" and (d > 128 or d % 8):
        return f"head_dim {d} (cuDNN: a multiple of 8, at most 128)"
    if name == "sdpa_efficient" and hq != hkv:
        return f"GQA {hq}/{hkv} (the memory-efficient backend needs Hq == Hkv)"
    return None


def sdpa_candidate(name: str, backend: str, check: str | None = None) -> Candidate:
    """``topg::attention`` on ``F.scaled_dot_product_attention`` with one backend forced
    (``backend``: an ``SDPBackend`` member name). ``check`` names the
    ``torch.backends.cuda`` function that has the last word on CUDA tensors (None: none,
    e.g. the math backend the CPU tests use)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    member = getattr(SDPBackend, backend)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default

    def supports(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any
    ) -> str | None:
        why = _sdpa_static(name, query, key, kw)
        if why is not None or check is None or query.device.type != "cuda":
            return why
        params = torch.backends.cuda.SDPAParams(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), None, 0.0,
            bool(kw.get("causal", False)), query.shape[2] != key.shape[2],
        )  # fmt: skip
        if not getattr(torch.backends.cuda, check)(params, False):
            return f"torch.backends.cuda.{check} refuses the call (dtype, layout, GPU or disabled)"
        return None

    def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any) -> torch.Tensor:
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # [B, H, S, D]
        with sdpa_kernel([member]):
            out = sdpa.decompose(
                q, k, v, None, 0.0, bool(kw.get("causal", False)),
                scale=kw.get("scale"), enable_gqa=q.shape[1] != k.shape[1],
            )  # fmt: skip
        return out.transpose(1, 2).contiguous()  # [B, S, H, D], as topg returns

    return Candidate(name, "attention", run, supports)


# --- fused_moe: grouped GEMM and the loop over the hit experts --------------------------


def _moe_combine(y: torch.Tensor, perm: torch.Tensor, t: int, k: int) -> torch.Tensor:
    """Assignment rows ``y`` (fp32, sorted by expert: row ``i`` is assignment ``perm[i]``)
    -> ``[T, H]``: the ``k`` rows of a token summed in slot order (no atomics)."""
    buf = torch.empty_like(y)
    buf[perm] = y
    return buf.view(t, k, y.shape[-1]).sum(1)


def _gated(gu: torch.Tensor, inter: int, activation: str) -> torch.Tensor:
    """``act(gate) * up`` in fp32, rounded to the GEMM dtype (as the GPU engines do)."""
    g = ACTIVATIONS[activation](gu[:, :inter].float()) * gu[:, inter:].float()
    return g.to(gu.dtype)


def _grouped_mm_supports(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                         topk_weights: torch.Tensor, topk_ids: torch.Tensor, **kw: Any) -> str | None:  # fmt: skip
    h, inter = hidden_states.shape[1], w_down.shape[-1]
    if hidden_states.device.type == "cuda":
        if hidden_states.dtype != torch.bfloat16:
            return f"dtype {dtype_name(hidden_states.dtype)} (torch._grouped_mm on CUDA: bf16)"
        cap = torch.cuda.get_device_capability(hidden_states.device)
        if cap < (9, 0):
            return f"sm_{cap[0]}{cap[1]} (torch._grouped_mm on CUDA: sm_90+)"
    if h % 8 or inter % 8:
        return f"H={h} or I={inter} not a multiple of 8 (16-byte rows)"
    if hidden_states.shape[0] == 0 or topk_ids.shape[1] == 0:
        return "empty input"
    return None


def _grouped_mm_run(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    activation: str = "silu") -> torch.Tensor:  # fmt: skip
    t, k = topk_ids.shape
    e, inter = w_gate_up.shape[0], w_down.shape[-1]
    ids = topk_ids.reshape(-1).long()
    valid = (ids >= 0) & (ids < e)
    # Ids outside [0, E) sort last and are dropped (as topg's CUDA kernel does with the
    # index checks off): no host read, so the call can be captured in a CUDA graph.
    key, perm = torch.where(valid, ids, e).sort(stable=True)
    offs = torch.bincount(key, minlength=e + 1)[:e].cumsum(0).to(torch.int32)
    x = hidden_states[perm // k]
    gu = torch._grouped_mm(x, w_gate_up.transpose(1, 2), offs=offs)
    y = torch._grouped_mm(_gated(gu, inter, activation), w_down.transpose(1, 2), offs=offs)
    w = topk_weights.reshape(-1)[perm].float()
    y = torch.where(valid[perm, None], y.float() * w[:, None], 0.0)  # rows past offs[-1]: junk
    return _moe_combine(y, perm, t, k).to(hidden_states.dtype)


def _expert_loop_supports(hidden_states: torch.Tensor, *args: Any, **kw: Any) -> str | None:
    if _capturing(hidden_states):
        return "reads the routing on the host: not while a CUDA graph is captured"
    return None


def _expert_loop_run(hidden_states: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                     activation: str = "silu") -> torch.Tensor:  # fmt: skip
    t, k = topk_ids.shape
    e, inter = w_gate_up.shape[0], w_down.shape[-1]
    ids = topk_ids.reshape(-1).long()
    # One host read: per-expert counts, with bins for ids below 0 and at or past E.
    counts = torch.bincount(ids.clamp(-1, e) + 1, minlength=e + 2).tolist()
    if counts[0] or counts[-1]:
        raise RuntimeError(
            f"topg::fused_moe: argument 'topk_ids' holds an expert id outside [0, {e}) "
            "(the experts of 'w_gate_up')"
        )
    _, perm = ids.sort(stable=True)
    token = perm // k
    weight = topk_weights.reshape(-1)[perm].float()
    y = torch.empty(t * k, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
    start = 0
    for expert, n in enumerate(counts[1:-1]):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gu = hidden_states[token[rows]] @ w_gate_up[expert].T
        y[rows] = (_gated(gu, inter, activation) @ w_down[expert].T).float() * weight[rows, None]
        start += n
    return _moe_combine(y, perm, t, k).to(hidden_states.dtype)


def grouped_mm_candidate() -> Candidate:
    """``fused_moe`` as two ``torch._grouped_mm`` calls over the assignments sorted by
    expert (no host read: graph-capturable)."""

    def available() -> str | None:
        return None if hasattr(torch, "_grouped_mm") else "this torch has no torch._grouped_mm"

    return Candidate("grouped_mm", "fused_moe", _grouped_mm_run, _grouped_mm_supports, available)


def expert_loop_candidate() -> Candidate:
    """``fused_moe`` as a loop over the experts that were hit, two GEMMs each."""
    return Candidate("expert_loop", "fused_moe", _expert_loop_run, _expert_loop_supports)


# --- linear ------------------------------------------------------------------------------


def torch_linear_candidate() -> Candidate:
    """``aten::linear`` (cuBLAS on CUDA), below the key ``torch_topg.enable()`` uses."""
    linear = torch.ops.aten.linear.default

    def run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Any:
        return linear.decompose(input, weight, bias)

    return Candidate("torch_linear", "linear", run)


# --- Triton ------------------------------------------------------------------------------


def triton_candidate(op: str, module: str | None = None) -> Candidate:
    """``torch_topg.triton_kernels.<op>``: functions ``<op>`` (the op's signature plus a
    keyword-only ``config``) and ``supports`` (same arguments, None or a reason), imported
    on first use. A missing module or function makes the candidate unavailable, saying so."""
    module = module or f"torch_topg.triton_kernels.{op}"
    state: dict[str, Any] = {}

    def load() -> Any:
        if "mod" not in state:
            state["mod"] = importlib.import_module(module)
        return state["mod"]

    def available() -> str | None:
        try:
            mod = load()
        except ImportError as exc:
            return f"{module} cannot be imported ({exc})"
        missing = [f for f in (op, "supports") if not callable(getattr(mod, f, None))]
        return f"{module} has no {' / '.join(missing)}" if missing else None

    def supports(*args: Any, **kwargs: Any) -> str | None:
        t = _first_tensor(args)
        if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "device cpu without TRITON_INTERPRET=1"
        return load().supports(*args, **kwargs)

    def run(*args: Any, config: dict | None = None, **kwargs: Any) -> Any:
        return getattr(load(), op)(*args, config=config, **kwargs)

    return Candidate("triton", op, run, supports, available, tunable=True)


def candidates(op: str) -> list[Candidate]:
    """Every candidate of ``op`` (a ``DISPATCHED_ON_CUDA`` op), ``reference`` last."""
    extra: list[Candidate]
    if op == "attention":
        extra = [sdpa_candidate(n, b, c) for n, (b, c) in SDPA_BACKENDS.items()]
    elif op == "paged_attention":
        extra = [triton_candidate(op)]
    elif op == "fused_moe":
        extra = [grouped_mm_candidate(), expert_loop_candidate(), triton_candidate(op)]
    elif op == "linear":
        extra = [torch_linear_candidate()]
    else:
        raise ValueError(f"topg::{op} has no dispatch candidates")
    return [topg_candidate(op), *extra, reference_candidate(op)]
