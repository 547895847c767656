"""transformers 5 experts -> ``topg::fused_moe``, substituted while dynamo traces.

transformers 5 runs a MoE block's experts through one of several implementations,
chosen by ``config._experts_implementation``: ``grouped_mm`` (default, traceable),
``batched_mm``, or ``eager`` (the class's own forward: a Python loop over the experts
that were hit, which dynamo cannot trace in one graph - the set of experts depends on
the data). None of them is a pattern a graph pass can recognise reliably, so instead
each is registered with ``torch.compiler.substitute_in_graph``: when dynamo inlines one,
it traces :func:`_topg_experts` instead, which is one ``topg::fused_moe`` call with the
same semantics. The compiled decoder has no graph break whichever implementation the
model was loaded with.

Variants ``fused_moe`` does not cover (a bias, no gate, transposed or interleaved
weights, a custom gate, an unknown activation, expert parallelism: the one check,
:func:`torch_topg.ops.fused_moe.experts_supported`) trace a copy of the original
function instead, so their behaviour is unchanged.

The substitution is process-wide and applies to any backend (same semantics): it is
installed when ``torch_topg.compile`` is imported, which ``backend="topg"`` does.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

from torch_topg.ops.fused_moe import experts_activation, experts_supported

_lock = threading.Lock()
_registered: set[int] = set()
#: Names of the functions substituted so far (for explain and the tests).
SUBSTITUTED: list[str] = []


def _copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A new function object with ``fn``'s code: dynamo inlines it like the original,
    but it is not substituted (the substitution is keyed by the function object)."""
    new = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    return new


def _make_substitute(original: Callable[..., Any]) -> Callable[..., Any]:
    fallback = _copy(original)

    def _topg_experts(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
        if args or kwargs or experts_supported(self) is not None or hidden_states.dim() != 2:
            return fallback(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        weights = top_k_weights
        if weights.dtype not in (torch.float32, hidden_states.dtype):
            weights = weights.float()
        return torch.ops.topg.fused_moe.default(
            hidden_states,
            self.gate_up_proj,
            self.down_proj,
            weights,
            top_k_index,
            activation=experts_activation(self),
        )

    return _topg_experts


def _substitute(fn: Callable[..., Any], label: str) -> None:
    if id(fn) in _registered:
        return
    try:
        torch.compiler.substitute_in_graph(fn, skip_signature_check=True)(_make_substitute(fn))
    except ValueError:  # already substituted (e.g. by an earlier import of this module)
        pass
    _registered.add(id(fn))
    SUBSTITUTED.append(label)


def register_experts_class(cls: type) -> None:
    """Substitutes ``cls``'s original (eager) experts forward; call it for an experts
    class defined after ``torch_topg.compile`` was imported, before compiling."""
    fwd = getattr(cls, "forward", None)
    original = getattr(fwd, "__wrapped__", None)
    if original is not None:
        with _lock:
            _substitute(original, f"{cls.__module__}.{cls.__qualname__}.forward")


def install() -> None:
    """Substitutes transformers' experts implementations loaded in this process.

    Called on import and by the backend before each compile (cheap when nothing is
    new), so experts classes imported later are covered from their next compile on."""
    moe = sys.modules.get("transformers.integrations.moe")
    if moe is None:
        if "transformers" not in sys.modules:
            return
        try:
            import transformers.integrations.moe as moe
        except Exception:  # transformers too old or broken: nothing to substitute
            return
    with _lock:
        for name in ("grouped_mm_experts_forward", "batched_mm_experts_forward"):
            fn = getattr(moe, name, None)
            if fn is not None:
                _substitute(fn, f"transformers.integrations.moe.{name}")
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("transformers.models.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            if isinstance(obj, type) and hasattr(obj, "_apply_gate") and obj.__module__ == mod_name:
                register_experts_class(obj)
