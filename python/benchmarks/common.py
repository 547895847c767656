"""What every op benchmark family shares: the result row and the physical limits.

A family module (``families/<family>.py``) exposes ``run(quick: bool) -> list[Row]``.
Times come from ``torch_topg.utils.benchmark.bench`` (the one timing helper); each row
holds topg's time, the baselines measured in the same run, and the physical-limit time
(bytes over the measured read bandwidth, or FLOPs over the measured GEMM rate).
"""

from __future__ import annotations

import dataclasses

from torch_topg.utils.benchmark import bench, gemm_rate, read_bandwidth

__all__ = ["Row", "bench", "bw_limit_ms", "gemm_limit_ms", "gemm_rate", "ms", "read_bandwidth"]


@dataclasses.dataclass
class Row:
    family: str
    op: str
    case: str  # sizes, e.g. "B=1 S=512 Hq=16 Hkv=4 D=64 causal"
    dtype: str  # "fp32" | "bf16" | "fp16"
    topg_ms: float
    # name -> ms measured in the same run, e.g. {"sdpa": 1.2, "reference": 3.4}
    baselines: dict[str, float]
    limit_ms: float | None = None  # physical-limit time for this case
    limit_kind: str = ""  # "read bw" | "gemm"
    # the target for this row: (baseline name or "limit", minimum ratio), e.g.
    # ("sdpa", 1.2) means topg must be >= 1.2x faster than sdpa; ("limit", 0.8) means
    # topg reaches >= 80% of the physical limit (limit_ms / topg_ms >= 0.8).
    target: tuple[str, float] | None = None

    def ratio(self, name: str) -> float:
        """Speed-up of topg over a baseline, or fraction of the limit for "limit"."""
        other = self.limit_ms if name == "limit" else self.baselines[name]
        assert other is not None
        return other / self.topg_ms

    @property
    def ok(self) -> bool | None:
        if self.target is None:
            return None
        name, minimum = self.target
        return self.ratio(name) >= minimum


def ms(timing) -> float:
    return timing.median_s * 1e3


def bw_limit_ms(nbytes: float) -> float:
    """Time to read ``nbytes`` at the measured memory read bandwidth."""
    return nbytes / read_bandwidth() * 1e3


def gemm_limit_ms(flops: float) -> float:
    """Time for ``flops`` at the measured fp32 GEMM rate of torch on this machine."""
    return flops / gemm_rate() * 1e3
