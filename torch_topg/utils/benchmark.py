"""The one timing helper used by every benchmark (and by anything else that times).

``bench(fn)`` times a callable with warm-up and repeated runs and returns the median
(robust to the noise of a shared machine). ``read_bandwidth()`` and ``gemm_rate()``
measure the physical limits of this machine in the same run, so that benchmarks
report ratios rather than absolute numbers from another day.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    runs: int

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def median_us(self) -> float:
        return self.median_s * 1e6


def _sync(device: str | None) -> None:
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    min_runs: int = 5,
    max_runs: int = 1000,
    min_time_s: float = 0.2,
    device: str | None = None,
) -> Timing:
    """Median wall time of ``fn()`` over at least ``min_runs`` runs and ``min_time_s``.

    Each run is timed on its own, so one slow run (a noisy neighbour) moves the median
    little. ``device="cuda"`` synchronises around each run.
    """
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (
        len(times) < min_runs or time.perf_counter() - start < min_time_s
    ):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return Timing(statistics.median(times), min(times), len(times))


_cache: dict[tuple, float] = {}


def read_bandwidth(nbytes: int = 256 << 20) -> float:
    """Measured main-memory read bandwidth in bytes/s (sum over a buffer >> caches)."""
    key = ("bw", nbytes)
    if key not in _cache:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        t = bench(lambda: buf.sum(), warmup=2, min_runs=7, min_time_s=0.5)
        _cache[key] = nbytes / t.min_s
    return _cache[key]


def gemm_rate(n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    """Measured dense GEMM rate of torch (``n x n x n``) in FLOP/s."""
    key = ("gemm", n, dtype)
    if key not in _cache:
        a = torch.randn(n, n, dtype=dtype)
        b = torch.randn(n, n, dtype=dtype)
        t = bench(lambda: torch.mm(a, b), warmup=2, min_runs=5, min_time_s=0.5)
        _cache[key] = 2 * n**3 / t.median_s
    return _cache[key]
