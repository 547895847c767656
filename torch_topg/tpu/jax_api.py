"""The topg ops on JAX arrays, through the Pallas kernels (imports JAX).

Same names and shapes as the torch ops; JAX arrays are immutable, so
``fused_add_rms_norm`` returns ``(normed, new_residual)``. ``interpret=None`` (default)
runs the kernels compiled on a TPU backend and in Pallas interpret mode elsewhere. Block
arguments pass through to the kernels (see their docstrings and docs/tpu.md).

    from torch_topg.tpu import jax_api
    out = jax_api.attention(q, k, v, causal=True)   # q [B, S, Hq, D], k/v [B, S, Hkv, D]
"""

from __future__ import annotations

from typing import Any

import jax

from torch_topg.tpu.kernels import kernels

__all__ = [
    "attention",
    "fused_add_rms_norm",
    "fused_moe",
    "moe_topk",
    "on_tpu",
    "paged_attention",
    "rms_norm",
]


def on_tpu() -> bool:
    """Whether JAX's default backend is a TPU (else the kernels run interpreted)."""
    return jax.default_backend() == "tpu"


def _interpret(interpret: bool | None) -> bool:
    return not on_tpu() if interpret is None else interpret


def rms_norm(
    x: Any, weight: Any, epsilon: float = 1e-6, *, interpret: bool | None = None, **blocks: int
) -> Any:
    return kernels("norm").rms_norm(x, weight, epsilon, interpret=_interpret(interpret), **blocks)


def fused_add_rms_norm(
    x: Any,
    residual: Any,
    weight: Any,
    epsilon: float = 1e-6,
    *,
    interpret: bool | None = None,
    **blocks: int,
) -> tuple[Any, Any]:
    k = kernels("norm")
    return k.fused_add_rms_norm(
        x, residual, weight, epsilon, interpret=_interpret(interpret), **blocks
    )


def attention(q: Any, k: Any, v: Any, *, interpret: bool | None = None, **kwargs: Any) -> Any:
    return kernels("attention").attention(q, k, v, interpret=_interpret(interpret), **kwargs)


def paged_attention(
    query: Any, key_cache: Any, value_cache: Any, block_tables: Any, seq_lens: Any, *,
    interpret: bool | None = None, **kwargs: Any,
) -> Any:  # fmt: skip
    return kernels("paged_attention").paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        interpret=_interpret(interpret),
        **kwargs,
    )


def moe_topk(
    router_logits: Any, top_k: int, *, interpret: bool | None = None, **kwargs: Any
) -> tuple[Any, Any]:
    return kernels("moe").moe_topk(router_logits, top_k, interpret=_interpret(interpret), **kwargs)


def fused_moe(
    hidden_states: Any, w_gate_up: Any, w_down: Any, topk_weights: Any, topk_ids: Any, *,
    interpret: bool | None = None, **kwargs: Any,
) -> Any:  # fmt: skip
    return kernels("moe").fused_moe(
        hidden_states,
        w_gate_up,
        w_down,
        topk_weights,
        topk_ids,
        interpret=_interpret(interpret),
        **kwargs,
    )
