"""Packed weight formats of ``linear_q``: a name, a block, and the bytes of one row.

Every format packs a weight ``[N, K]`` into one ``uint8`` tensor ``[N, row_bytes(K)]``:
each row is a run of self-contained blocks (scales inside the block), so a row slice is
a slice of the packed tensor and a kernel reads one stream per row.

GGUF block formats, byte for byte as a GGUF file stores them (``K`` must be a multiple
of the block; ``d``, ``m``, ``dmin`` are IEEE half, little-endian; ``q`` values are
unsigned nibbles / bytes unless noted):

========  =====  =====  ==========================================================
format    block  bytes  layout of one block -> weight
========  =====  =====  ==========================================================
``q8_0``  32     34     ``d``, 32 x int8 ``q`` -> ``q * d``
``q4_0``  32     18     ``d``, 16 bytes: low nibbles are elements 0-15, high nibbles
                        16-31 -> ``d * (q - 8)``
``q4_1``  32     20     ``d``, ``m``, 16 bytes as q4_0 -> ``d * q + m``
``q5_0``  32     22     ``d``, 4 bytes ``qh`` (bit ``i`` of the little-endian word is
                        element ``i``'s 5th bit, +16), 16 bytes as q4_0
                        -> ``d * (q - 16)``
``q5_1``  32     24     ``d``, ``m``, ``qh`` and 16 bytes as q5_0 -> ``d * q + m``
``q4_k``  256    144    ``d``, ``dmin``, 12 bytes of eight 6-bit (scale, min) pairs,
                        128 bytes: 4 chunks of 32 bytes, each giving 64 elements (low
                        nibbles 32, then high nibbles 32); sub-block ``j`` of 32:
                        ``(d * sc_j) * q - dmin * mn_j``
``q5_k``  256    176    ``d``, ``dmin``, 12 scale bytes as q4_k, 32 bytes ``qh``, 128
                        bytes as q4_k's nibbles; sub-block ``j``'s element ``i`` adds
                        bit ``j`` of ``qh[i]`` as its 5th bit (+16):
                        ``(d * sc_j) * q - dmin * mn_j``
``q6_k``  256    210    128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 x int8
                        scales, ``d``; 6-bit ``q`` in two halves of 128; sub-block
                        ``j`` of 16: ``(d * sc_j) * (q - 32)``
========  =====  =====  ==========================================================

Formats for quantising float weights (``torch_topg.quant.quantize_weight``):

* ``int4_g32`` / ``int4_g64`` / ``int4_g128``: groupwise asymmetric int4; a group of
  ``G`` is ``d``, ``m`` (half) then ``G / 2`` bytes, low nibbles the first half of the
  group, high nibbles the second -> ``d * q + m``. ``int4_g32`` is q4_1's layout.
  ``K`` need not divide by ``G``: the last group is padded (the padding is never read
  back: the weight is ``[N, K]``).
* ``int8``: per output channel; a row is a float32 scale ``s`` then ``K`` int8 ``q``
  -> ``q * s``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GGUF_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k")
INT4_GROUPS = (32, 64, 128)
OWN_FORMATS = ("int8", *(f"int4_g{g}" for g in INT4_GROUPS))


@dataclass(frozen=True)
class QuantFormat:
    """One packed format.

    Attributes:
        name: the ``format`` string of ``linear_q``.
        block: weights per block (0: one block per row, ``int8``).
        block_bytes: bytes per block (for ``int8``: the row header, the float32 scale).
        gguf_type: the ``GGMLQuantizationType`` value, or None.
        pads: whether ``K`` may leave the last block partly filled.
        bits: nominal bits per weight of a full block (for tables).
    """

    name: str
    block: int
    block_bytes: int
    gguf_type: int | None
    pads: bool

    @property
    def bits(self) -> float:
        return 8.0 if self.block == 0 else 8.0 * self.block_bytes / self.block

    def row_bytes(self, k: int) -> int:
        """Bytes of one packed row of ``k`` weights (after :meth:`check_k`)."""
        if self.block == 0:
            return self.block_bytes + k
        return -(-k // self.block) * self.block_bytes

    def blocks(self, k: int) -> int:
        return 1 if self.block == 0 else -(-k // self.block)

    def k_problem(self, k: int) -> str | None:
        """None when rows of ``k`` weights can be packed, else what is wrong."""
        if self.block and not self.pads and k % self.block:
            return f"a multiple of {self.block} (the block of {self.name})"
        return None


# GGMLQuantizationType values (gguf/constants.py): Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8,
# Q4_K 12, Q5_K 13, Q6_K 14.
FORMATS: dict[str, QuantFormat] = {
    "q8_0": QuantFormat("q8_0", 32, 34, 8, False),
    "q4_0": QuantFormat("q4_0", 32, 18, 2, False),
    "q4_1": QuantFormat("q4_1", 32, 20, 3, False),
    "q5_0": QuantFormat("q5_0", 32, 22, 6, False),
    "q5_1": QuantFormat("q5_1", 32, 24, 7, False),
    "q4_k": QuantFormat("q4_k", 256, 144, 12, False),
    "q5_k": QuantFormat("q5_k", 256, 176, 13, False),
    "q6_k": QuantFormat("q6_k", 256, 210, 14, False),
    "int8": QuantFormat("int8", 0, 4, None, True),
    **{f"int4_g{g}": QuantFormat(f"int4_g{g}", g, 4 + g // 2, None, True) for g in INT4_GROUPS},
}

#: GGMLQuantizationType value -> format name.
BY_GGUF_TYPE: dict[int, str] = {f.gguf_type: n for n, f in FORMATS.items() if f.gguf_type}


def get_format(name: str) -> QuantFormat:
    """The format called ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}; known: {', '.join(FORMATS)}") from None


# --- de-quantisation -----------------------------------------------------------------
# Each function maps uint8 blocks [n, block_bytes] to float32 [n, block] with the same
# float32 operations, in the same order, as gguf-py's de-quantiser (bit-exact).


def _as(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bytes [n, b] reinterpreted as ``dtype`` [n, b / size] (copied first: a slice of a
    packed row has neither the stride nor the offset that ``view(dtype)`` needs)."""
    return torch.empty(b.shape, dtype=torch.uint8, device=b.device).copy_(b).view(dtype)


def _half(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row [n, 2] -> float32 [n, 1] (little-endian IEEE half)."""
    return _as(b, torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., b] -> [..., 2b]: the low nibbles, then the high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _as(b[:, 2:], torch.int8).float() * _half(b[:, :2])


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).to(torch.int8) - 8
    return _half(b[:, :2]) * q.float()


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _half(b[:, :2]) * _nibbles(b[:, 4:]).float() + _half(b[:, 2:4])


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """q5_0 / q5_1's codes [n, 32] from ``qh`` (4 bytes: a little-endian word whose bit
    ``i`` is element ``i``'s 5th bit) and ``qs`` (16 bytes of nibbles, as q4_0)."""
    bit = torch.arange(8, dtype=torch.uint8, device=qh.device)
    high = ((qh.unsqueeze(-1) >> bit) & 1).reshape(qh.shape[0], 32)  # byte i / 8, bit i % 8
    return _nibbles(qs) | (high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _five_bits(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16
    return _half(b[:, :2]) * q.float()


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _half(b[:, :2]) * _five_bits(b[:, 4:8], b[:, 8:]).float() + _half(b[:, 2:4])


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_k's 12 scale bytes [n, 12] -> (scales, mins) [n, 8], 6 bits each. Bytes 0-3
    hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    mn = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 16:].reshape(n, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32).float()
    scale = (d * sc.float()).unsqueeze(-1)
    offset = (dmin * mn.float()).unsqueeze(-1)
    return (scale * q - offset).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dmin = _half(b[:, 0:2]), _half(b[:, 2:4])
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48].unsqueeze(1)  # [n, 1, 32]: bit j of byte i -> element i of sub-block j
    high = (qh >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
    qs = b[:, 48:].reshape(n, 4, 32)
    low = torch.stack([qs & 0x0F, qs >> 4], dim=2).reshape(n, 8, 32)
    q = (low | (high << 4)).float()
    scale = (d * sc.float()).unsqueeze(-1)
    offset = (dmin * mn.float()).unsqueeze(-1)
    return (scale * q - offset).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh = b[:, 0:128].reshape(n, 2, 64), b[:, 128:192].reshape(n, 2, 32)
    sc = _as(b[:, 192:208], torch.int8).float()
    scale = (_half(b[:, 208:210]) * sc).unsqueeze(-1)  # [n, 16, 1]
    low = torch.stack([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    high = torch.stack([(qh >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
    q = (low | (high << 4)).to(torch.int8) - 32
    return (scale * q.reshape(n, 16, 16).float()).reshape(n, 256)


def _int4(group: int) -> Callable[[torch.Tensor], torch.Tensor]:
    def dequant(b: torch.Tensor) -> torch.Tensor:
        return _half(b[:, :2]) * _nibbles(b[:, 4:]).float() + _half(b[:, 2:4])

    assert group % 2 == 0
    return dequant


_DEQUANT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q5_0": _q5_0,
    "q5_1": _q5_1,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
    **{f"int4_g{g}": _int4(g) for g in INT4_GROUPS},
}


def dequantize(packed: torch.Tensor, format: str, k: int | None = None) -> torch.Tensor:
    """Unpack ``packed`` (uint8 ``[..., row_bytes]``) to float32 ``[..., k]``.

    ``k`` (the weights per row) defaults to the largest that fits the row; it is needed
    only for padded formats whose last group is partly filled.
    """
    f = get_format(format)
    if packed.dtype != torch.uint8:
        raise ValueError(f"dequantize: packed weights must be uint8, got {packed.dtype}")
    rb = packed.shape[-1]
    if k is None:
        k = rb - f.block_bytes if f.block == 0 else rb // f.block_bytes * f.block
    problem = f.k_problem(k)
    if problem is not None or f.row_bytes(k) != rb:
        raise ValueError(
            f"dequantize: rows of {rb} bytes do not hold {k} weights in {format} "
            f"(expected {f.row_bytes(k)} bytes" + (f"; K must be {problem})" if problem else ")")
        )
    lead = packed.shape[:-1]
    if k == 0:
        return torch.zeros(*lead, 0, device=packed.device)
    rows = packed.reshape(-1, rb)
    if f.block == 0:  # int8: float32 scale, then K int8
        s = _as(rows[:, :4], torch.float32)
        return (_as(rows[:, 4:], torch.int8).float() * s).reshape(*lead, k)
    blocks = rows.reshape(-1, f.block_bytes)
    out = _DEQUANT[format](blocks).reshape(rows.shape[0], f.blocks(k) * f.block)[:, :k]
    return out.reshape(*lead, k)


# The K-quants: one activation scale per super-block of 256 with int8 activations.
_GROUP_256 = frozenset({"q4_k", "q5_k", "q6_k"})


def activation_group(format: str) -> int:
    """How many activations share one int8 scale in ``linear_q(..., format,
    int8_activations=True)``: 256 for the K-quants (``q4_k``, ``q5_k``, ``q6_k``: one scale per
    weight super-block, as llama.cpp's Q8_K, so a super-block's products sum in int32), else
    32 (one per weight block, as llama.cpp's Q8_0)."""
    return 256 if format in _GROUP_256 else 32


def quantize_activations(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """``linear_q(..., int8_activations=True)``'s view of ``x`` ``[..., K]``: per group of
    ``group`` values (32 or 256: ``activation_group(format)``; zero padded),
    ``d = amax / 127``, ``q = round_half_even(clamp(x / d, -127, 127))`` (with ``1 / d`` in
    float32, 0 for an all-zero group); returns ``q * d`` (float32 ``[..., K]``). A group
    holding NaN or inf becomes NaN."""
    if group not in (32, 256):
        raise ValueError(f"quantize_activations: group must be 32 or 256, got {group}")
    k = x.shape[-1]
    xb = torch.nn.functional.pad(x.float(), (0, -k % group)).reshape(*x.shape[:-1], -1, group)
    finite = torch.isfinite(xb).all(-1, keepdim=True)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.round((xb * inv).clamp(-127, 127))
    out = torch.where(finite, q * d, torch.full_like(xb, float("nan")))
    return out.reshape(*x.shape[:-1], -1)[..., :k]
