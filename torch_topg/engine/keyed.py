"""Keyed randomness for the sampler: counter-based hashes of (seed, position, salt,
token id), the Gumbel race that samples with them, and the draws speculative
verification needs. Nothing here has state: a row's numbers depend only on its key.
See ``sampling.py``'s docstring for why the race samples exactly from the distribution.

Contract with ``sampling.py``: the sampler is this module's one caller and imports its
underscored building blocks (``_key32``, ``_race_scores``, ``_ids_mix``, ``_Scratch``)
directly; they are private to the pair, not to this file. Nothing else may use them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

SALT_SAMPLE = 0
SALT_ACCEPT = 1
SALT_RESIDUAL = 2

_U64 = (1 << 64) - 1


def _s64(c: int) -> int:
    """``c`` mod 2**64 as a signed int64 (two's complement)."""
    c &= _U64
    return c - (1 << 64) if c >= 1 << 63 else c


def _s32(c: int) -> int:
    c &= 0xFFFFFFFF
    return c - (1 << 32) if c >= 1 << 31 else c


_GAMMA64 = _s64(0x9E3779B97F4A7C15)
_MIX64_1 = _s64(0xBF58476D1CE4E5B9)
_MIX64_2 = _s64(0x94D049BB133111EB)
_GAMMA32 = _s32(0x9E3779B9)
_LB32_1 = _s32(0x7FEB352D)  # lowbias32 (Chris Wellons' hash prospector)
_LB32_2 = _s32(0x846CA68B)


def _srl64(x: Tensor, s: int) -> Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64: one step (add the golden gamma) and its finaliser; int64 wraps mod 2**64."""
    x = x + _GAMMA64
    x = (x ^ _srl64(x, 30)) * _MIX64_1
    x = (x ^ _srl64(x, 27)) * _MIX64_2
    return x ^ _srl64(x, 31)


def seed_tensor(values: Sequence[int] | Tensor, device: torch.device | str | None = None) -> Tensor:
    """Seeds or positions as an int64 tensor ``[B]``; Python ints are taken mod 2**64."""
    if isinstance(values, Tensor):
        return values.to(device=device, dtype=torch.int64)
    return torch.tensor([_s64(int(v)) for v in values], dtype=torch.int64, device=device)


def _row_key(seeds: Tensor, positions: Tensor, salt: int) -> Tensor:
    """int64 ``[B]``: a splitmix64 hash of (seed, position, salt)."""
    k = mix64(seeds.to(torch.int64) ^ _s64(salt * 0xD1B54A32D192ED03))
    return mix64(k ^ positions.to(torch.int64))


def keyed_uniform(seeds: Tensor, positions: Tensor, salt: int = SALT_ACCEPT) -> Tensor:
    """Uniforms keyed by (seed, position, salt): float32 ``[B]`` in (0, 1).

    ``seeds``, ``positions``: int64 ``[B]`` (see :func:`seed_tensor`). The values are odd
    multiples of 2**-24 (23 random bits), so neither 0 nor 1 occurs.
    """
    k = _row_key(seeds, positions, salt)
    return (_srl64(k, 41).to(torch.float32) + 0.5) * 2.0**-23


def _key32(seeds: Tensor, positions: Tensor, salt: int) -> Tensor:
    """int32 ``[B, 1]``: the low 32 bits of the row key, for the per-token hash."""
    k = _row_key(seeds, positions, salt) & 0xFFFFFFFF
    return ((k ^ 0x80000000) - 0x80000000).to(torch.int32).unsqueeze(1)


class _Scratch:
    """Reusable CPU buffers for a step's ``[R, V]`` temporaries (one slot per use).

    glibc returns freed multi-megabyte blocks to the OS, so fresh temporaries page-fault
    on every step: measured, about half the CPU time of a sampling step. Elsewhere (CUDA's
    caching allocator) and above ``_SCRATCH_MAX`` elements this just allocates.
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype], Tensor] = {}

    def __call__(
        self, slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> Tensor:
        n = math.prod(shape)
        if torch.device(device).type != "cpu" or n > _SCRATCH_MAX:
            return torch.empty(shape, dtype=dtype, device=device)
        b = self._bufs.get((slot, dtype))
        if b is None or b.numel() < n:
            b = self._bufs[slot, dtype] = torch.empty(n, dtype=dtype)
        return b[:n].view(shape)


_SCRATCH_MAX = 1 << 24  # elements (64 MiB of fp32) per slot


def _fresh(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _race_scores(logits: Tensor, key32: Tensor, ids_mix: Tensor, scratch: Any = _fresh) -> Tensor:
    """``logits + G``: G standard Gumbel keyed by (row key, token id); fp32 ``[R, C]``.

    ``ids_mix``: int32 ``[C]`` or ``[R, C]``, the token ids times the 32-bit golden ratio.
    The result is ``scratch``'s "noise" buffer.
    """
    shape = torch.broadcast_shapes(ids_mix.shape, key32.shape, logits.shape)
    dev = ids_mix.device
    x = torch.bitwise_xor(ids_mix, key32, out=scratch("hash", shape, torch.int32, dev))
    tmp = scratch("tmp", shape, torch.int32, dev)
    for shift, mul in ((16, _LB32_1), (15, _LB32_2), (16, None)):
        # x ^= x >>> shift (torch's >> is arithmetic: mask the sign copies off)
        torch.bitwise_right_shift(x, shift, out=tmp)
        tmp &= (1 << (32 - shift)) - 1
        x ^= tmp
        if mul is not None:
            x *= mul  # int32 wraps mod 2**32
    x &= 0x7FFFFFFF
    # w = (x + 1/2) / 2**31 in (0, 1]; t = log(1 - w) = -E with E ~ Exp(1); G = -log(E).
    # w rounding to 1 (chance ~3e-8) gives E = inf, G = -inf: that token loses, no NaN.
    t = torch.mul(x, -(2.0**-31), out=scratch("noise", shape, torch.float32, dev))
    t.sub_(2.0**-32).log1p_()
    return torch.sub(logits, t.neg_().log_(), out=t)


def keyed_gumbel(
    seeds: Tensor, positions: Tensor, ids: Tensor | int, salt: int = SALT_SAMPLE
) -> Tensor:
    """Standard Gumbel noise keyed by (seed, position, salt, token id): fp32 ``[B, C]``.

    ``ids``: int ``[B, C]`` or ``[C]`` token ids, or the vocabulary size ``V`` (ids
    ``0..V-1``). The sampler's draw for a row is ``argmax(final_logits + keyed_gumbel(...,
    SALT_SAMPLE))``: the same noise whether the row was raced over the full vocabulary or
    over a candidate set.
    """
    if isinstance(ids, int):
        ids = torch.arange(ids, device=seeds.device)
    key = _key32(seeds, positions, salt)
    zero = torch.zeros(1, device=ids.device, dtype=torch.float32)
    return _race_scores(zero, key, _ids_mix(ids))


def _ids_mix(ids: Tensor) -> Tensor:
    return ids.to(torch.int32) * _GAMMA32


def sample_from_probs(
    probs: Tensor, seeds: Tensor, positions: Tensor, salt: int = SALT_SAMPLE
) -> Tensor:
    """Draw one token per row from ``probs`` ``[B, V]`` (unnormalised is fine) with keyed noise.

    Returns int64 ``[B]``. Zero-probability tokens are never drawn. With ``SALT_SAMPLE``
    and the sampler's :meth:`Sampler.processed_probs` this reproduces the sampler's draw
    (up to rounding of ``log(softmax)``); a speculative verifier races its residual
    distribution with ``SALT_RESIDUAL``.
    """
    p = probs.float()
    key = _key32(seeds, positions, salt)
    ids = torch.arange(p.shape[-1], device=p.device)
    return _race_scores(p.log(), key, _ids_mix(ids)).argmax(-1)


# --------------------------------------------------------------------------- the sampler
