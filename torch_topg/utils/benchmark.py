"""Kept for old imports: the timing harness lives in ``torch_topg.bench``."""

from torch_topg.bench import Stats, Timing, bench, compare, gemm_rate, read_bandwidth

__all__ = ["Stats", "Timing", "bench", "compare", "gemm_rate", "read_bandwidth"]
