"""Split math: how many heads / elements each rank gets for given split ratios.

Every split is computed in *units* (a KV head with its query heads; a block of
``align`` elements) with the largest-remainder method: each rank first gets the whole
part of ``units * ratio``; the units left go to the largest fractional parts (ties: the
lower rank). A rank left with none takes one from the largest shard. Fewer units than
ranks is impossible: the error names ``split_ratios`` and the sizes.

Attention heads move as KV groups: a rank that holds KV head ``j`` holds the query
heads that read it (``j * g .. (j + 1) * g - 1`` with ``g = q_heads / kv_heads``), so the
attention of every rank is an ordinary GQA attention with the same group size.

Element splits (MLP / expert intermediate size, vocabulary) use the largest power of
two ``align <= 64`` that divides the size and keeps every shard within 5% of its ideal
size (``size * ratio``); when none does, the alignment with the smallest deviation. An
even split of 3072 over 2 ranks is 1536 + 1536 (align 64); of 160 is 80 + 80 (align 16,
since 64 and 32 would give 96 + 64); ``[0.6, 0.4]`` of 3072 is 1856 + 1216 (align 64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_ALIGN = 64
#: An alignment is accepted when every shard is within this fraction of its ideal size.
TOLERANCE = 0.05


def normalize_ratios(split_ratios: Sequence[float] | None, tp_size: int) -> list[float]:
    """``split_ratios`` as fractions summing to 1 (None: an even split)."""
    if tp_size < 1:
        raise ValueError(f"tensor_parallel: tp_size must be >= 1, got {tp_size}")
    if split_ratios is None:
        return [1.0 / tp_size] * tp_size
    ratios = [float(r) for r in split_ratios]
    if len(ratios) != tp_size:
        raise ValueError(
            f"tensor_parallel: split_ratios {list(split_ratios)} has {len(ratios)} entries "
            f"for {tp_size} ranks (one ratio per rank)"
        )
    if any(not (r > 0) for r in ratios):  # also rejects NaN
        raise ValueError(f"tensor_parallel: split_ratios {list(split_ratios)} must all be > 0")
    total = sum(ratios)
    return [r / total for r in ratios]


def split_units(units: int, ratios: Sequence[float], what: str = "units") -> list[int]:
    """``units`` whole units over ``len(ratios)`` ranks (largest remainder, >= 1 each)."""
    ideal = [units * r for r in ratios]
    counts = [int(x) for x in ideal]
    order = sorted(range(len(ratios)), key=lambda i: (-(ideal[i] - counts[i]), i))
    for i in order[: units - sum(counts)]:
        counts[i] += 1
    if units < len(ratios):
        raise ValueError(
            f"tensor_parallel: split_ratios {[round(r, 4) for r in ratios]} cannot give every "
            f"rank at least one of the {units} {what}: use at most {units} ranks"
        )
    for i in range(len(counts)):  # a tiny ratio still gets one unit, from the largest shard
        if counts[i] == 0:
            counts[counts.index(max(counts))] -= 1
            counts[i] = 1
    return counts


def _aligned(size: int, ratios: Sequence[float], align: int) -> list[int] | None:
    try:
        return [c * align for c in split_units(size // align, ratios)]
    except ValueError:
        return None


def split_size(size: int, ratios: Sequence[float], what: str = "elements") -> list[int]:
    """``size`` elements over the ranks, each shard a multiple of a power-of-two alignment
    (see the module docstring for how the alignment is chosen)."""
    ideal = [size * r for r in ratios]
    best: tuple[float, list[int]] | None = None
    align = MAX_ALIGN
    while align >= 1:
        if size % align == 0:
            sizes = _aligned(size, ratios, align)
            if sizes is not None:
                dev = max(abs(s - x) / x for s, x in zip(sizes, ideal, strict=True))
                if dev <= TOLERANCE:
                    return sizes
                if best is None or dev < best[0]:
                    best = (dev, sizes)
        align //= 2
    if best is None:
        raise ValueError(
            f"tensor_parallel: split_ratios {[round(r, 4) for r in ratios]} cannot split "
            f"{size} {what} into {len(ratios)} non-empty shards"
        )
    return best[1]


def offsets(sizes: Sequence[int]) -> list[int]:
    """Start of each shard: ``[0, s0, s0 + s1, ...]`` (one entry per shard)."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


@dataclass(frozen=True)
class HeadSplit:
    """Attention heads of every rank: ``kv[r]`` KV heads and ``q[r]`` query heads."""

    kv: tuple[int, ...]
    q: tuple[int, ...]
    head_dim: int

    def q_range(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of the q projection (and columns of o) of ``rank``."""
        start = offsets(self.q)[rank] * self.head_dim
        return start, start + self.q[rank] * self.head_dim

    def kv_range(self, rank: int) -> tuple[int, int]:
        """Rows ``[start, end)`` of the k / v projections of ``rank``."""
        start = offsets(self.kv)[rank] * self.head_dim
        return start, start + self.kv[rank] * self.head_dim


def split_heads(
    num_heads: int, num_kv_heads: int, head_dim: int, ratios: Sequence[float]
) -> HeadSplit:
    """Whole KV groups per rank (each KV head with its ``num_heads / num_kv_heads`` query
    heads). KV heads are not replicated: each rank needs at least one."""
    if num_heads % num_kv_heads:
        raise ValueError(
            f"tensor_parallel: {num_heads} query heads are not a multiple of "
            f"{num_kv_heads} KV heads"
        )
    group = num_heads // num_kv_heads
    kv = split_units(num_kv_heads, ratios, f"KV heads ({num_heads} query heads)")
    return HeadSplit(tuple(kv), tuple(k * group for k in kv), head_dim)


def shard_range(sizes: Sequence[int], rank: int) -> tuple[int, int]:
    start = offsets(sizes)[rank]
    return start, start + sizes[rank]
