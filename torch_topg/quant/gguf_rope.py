"""Llama 3's RoPE frequency scaling, recovered from a GGUF file.

llama.cpp's converter writes Llama 3.x's ``rope_scaling`` (type ``llama3``: factor, low /
high frequency factors, the original context) not as metadata but as a tensor,
``rope_freqs.weight``: one divisor per rotary frequency. transformers' GGUF reader drops
it and builds the config with unscaled RoPE, so every Llama 3.1 / 3.2 file it reads runs
with the wrong rotary angles. :func:`llama3_rope_parameters` finds the llama3 parameters
whose divisors equal the file's (exactly, in float32, as the converter computes them)
among the published ones; the config then carries them and the model computes the same
angles as llama.cpp.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: Published llama3 rope_scaling values: factor (3.1: 8, 3.2: 32), the rest shared.
_FACTORS = (8.0, 16.0, 32.0, 64.0)
_LOW, _HIGH = (1.0,), (4.0,)
_ORIGINAL = (8192, 4096, 16384, 32768)


def llama3_divisors(
    theta: float, dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """The per-frequency divisors of llama3 RoPE scaling, float32 (the converter's
    formula: 1 above the high-frequency wavelength, ``factor`` below the low one, and a
    smooth blend between)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)))
    low_wl, high_wl = original / low, original / high
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / float(f)
        if wavelen < high_wl:
            out.append(1.0)
        elif wavelen > low_wl:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def llama3_rope_parameters(divisors: np.ndarray, theta: float, dim: int) -> dict[str, Any] | None:
    """transformers' ``rope_parameters`` for ``divisors`` (the file's ``rope_freqs``), or
    None when no published llama3 setting reproduces them."""
    got = np.asarray(divisors, dtype=np.float32).reshape(-1)
    for factor in _FACTORS:
        for low in _LOW:
            for high in _HIGH:
                for original in _ORIGINAL:
                    ref = llama3_divisors(theta, dim, factor, low, high, original)
                    if ref.shape == got.shape and np.allclose(ref, got, rtol=1e-6, atol=0):
                        return {"rope_type": "llama3", "rope_theta": theta, "factor": factor,
                                "low_freq_factor": low, "high_freq_factor": high,
                                "original_max_position_embeddings": original}  # fmt: skip
    return None


def apply_rope_freqs(config: Any, tensors: Any) -> Any:
    """``config`` with llama3 RoPE scaling when the file's tensors (objects with ``name``
    and ``data``: ``gguf_arch.read_file``'s, or a ``gguf.GGUFReader``'s ``tensors``) hold
    ``rope_freqs.weight`` and its config has plain RoPE; unchanged otherwise. Raises
    ValueError when the divisors match no llama3 setting (the model would run with
    angles other than the file's)."""
    t = next((t for t in tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return config
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default":
        return config
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    found = llama3_rope_parameters(np.array(t.data), theta, int(dim))
    if found is None:
        raise ValueError(
            "GGUF rope_freqs.weight: the RoPE frequency divisors match no llama3 scaling "
            "(factor 8-64, low 1, high 4, original context 4k-32k); cannot build the config"
        )
    config.rope_parameters = found
    return config
