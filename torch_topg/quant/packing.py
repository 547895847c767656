"""Quantising float weights into the packed formats of :mod:`torch_topg.formats`.

* ``int8`` and ``int4_g{32,64,128}``: this package's own formats (round to nearest);
* ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``, ``q5_1``: the same bytes as ggml's reference quantisers (and
  gguf-py's ``quants.quantize``), so a weight quantised here equals one quantised by
  llama.cpp's ``llama-quantize`` without an importance matrix.

The K-quants (``q4_k``, ``q5_k``, ``q6_k``) are read from GGUF files only: ggml's quantisers for
them search scales per sub-block, which is not reproduced here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_topg.formats import get_format

_HALF_MAX = 65504.0


def _to_half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float32 [n, 1] -> its IEEE half as 2 bytes [n, 2]."""
    return x.to(torch.float16).contiguous().view(torch.uint8)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes 0-15 [n, 2b] -> bytes [n, b]: element i in the low nibble of byte i, element
    b + i in its high nibble."""
    half = q.shape[-1] // 2
    return (q[:, :half] | (q[:, half:] << 4)).to(torch.uint8)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (C ``roundf``, which ggml's q8_0 uses)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = b.abs().amax(dim=-1, keepdim=True) / 127
    q = _round_away(b * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_to_half_bytes(d), q], dim=-1)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    peak = b.gather(-1, b.abs().argmax(dim=-1, keepdim=True))  # signed, largest magnitude
    d = peak / -8
    q = torch.trunc(b * _inverse(d) + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_to_half_bytes(d), _pack_nibbles(q)], dim=-1)


def _min_max_blocks(b: torch.Tensor, levels: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = b.amin(dim=-1, keepdim=True), b.amax(dim=-1, keepdim=True)
    return lo, (hi - lo) / (levels - 1)


def _pack_five(q: torch.Tensor) -> torch.Tensor:
    """Codes 0-31 [n, 32] -> ``qh`` (4 bytes: bit i of the little-endian word is code i's
    bit 4) then the low nibbles as :func:`_pack_nibbles` packs them [n, 20]."""
    bit = torch.arange(8, dtype=torch.uint8, device=q.device)
    high = ((q >> 4) & 1).reshape(-1, 4, 8) << bit
    return torch.cat([high.sum(-1, dtype=torch.uint8), _pack_nibbles(q & 0x0F)], dim=-1)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    peak = b.gather(-1, b.abs().argmax(dim=-1, keepdim=True))  # signed, largest magnitude
    d = peak / -16
    q = torch.trunc(b * _inverse(d) + 16.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_to_half_bytes(d), _pack_five(q)], dim=-1)


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    lo, d = _min_max_blocks(b, 32)
    q = torch.trunc((b - lo) * _inverse(d) + 0.5).clamp(0, 31).to(torch.uint8)
    return torch.cat([_to_half_bytes(d), _to_half_bytes(lo), _pack_five(q)], dim=-1)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    lo, d = _min_max_blocks(b)
    q = torch.trunc((b - lo) * _inverse(d) + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_to_half_bytes(d), _to_half_bytes(lo), _pack_nibbles(q)], dim=-1)


def _int4(b: torch.Tensor) -> torch.Tensor:
    # Codes are rounded against the stored (half) scale and minimum, so de-quantising
    # gives the nearest of the 16 levels that the block can express.
    lo, d = _min_max_blocks(b)
    d16, lo16 = d.to(torch.float16).float(), lo.to(torch.float16).float()
    q = torch.round((b - lo16) * _inverse(d16)).clamp(0, 15).to(torch.uint8)
    return torch.cat([_to_half_bytes(d), _to_half_bytes(lo), _pack_nibbles(q)], dim=-1)


_QUANT = {"q8_0": _q8_0, "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1}


def quantize_weight(weight: torch.Tensor, format: str) -> torch.Tensor:
    """Pack ``weight`` ``[..., K]`` (any float dtype) into ``format``.

    Returns:
        uint8 ``[..., row_bytes(K)]`` on the weight's device. Math is float32.

    Raises:
        ValueError: an unknown format, a format only read from files (K-quants), ``K``
            that the format cannot split into blocks, or a value outside the half range
            for a format that stores half scales.
    """
    f = get_format(format)
    if not weight.is_floating_point():
        raise ValueError(f"quantize_weight: weight must be floating point, got {weight.dtype}")
    k = weight.shape[-1]
    problem = f.k_problem(k)
    if problem is not None:
        raise ValueError(f"quantize_weight: K = {k} must be {problem}")
    lead = weight.shape[:-1]
    if k == 0 or weight.numel() == 0:  # no weights: scales of zero (int8) or no blocks
        return torch.zeros(*lead, f.row_bytes(k), dtype=torch.uint8, device=weight.device)
    w = weight.detach().reshape(-1, k).float()
    if not torch.isfinite(w).all():
        raise ValueError("quantize_weight: the weight holds NaN or inf")
    if format == "int8":
        s = w.abs().amax(dim=-1, keepdim=True) / 127
        q = torch.round(w * _inverse(s)).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        out = torch.cat([s.contiguous().view(torch.uint8), q], dim=-1)
        return out.reshape(*lead, f.row_bytes(k))
    if format not in _QUANT and not format.startswith("int4_"):
        raise ValueError(
            f"quantize_weight: {format} is read from GGUF files only; quantise to one of "
            "q8_0, q4_0, q4_1, q5_0, q5_1, int8, int4_g32, int4_g64, int4_g128"
        )
    if w.numel() and w.abs().max() > _HALF_MAX:
        raise ValueError(f"quantize_weight: |weight| exceeds {_HALF_MAX}, the half range")
    pad = -k % f.block
    if pad:  # the padding (zeros) widens the last group's range at most to include 0
        w = F.pad(w, (0, pad))
    blocks = w.reshape(-1, f.block)
    packed = (_QUANT.get(format) or _int4)(blocks)
    return packed.reshape(*lead, f.row_bytes(k))
