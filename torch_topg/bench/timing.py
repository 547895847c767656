"""Timing: warm-up, interleaved rounds, the median and the spread of figures and ratios.

``compare({"topg": f, "sdpa": g})`` calibrates each variant (how many calls make one
sample of at least ``min_sample_s``), then runs rounds in which every variant takes one
sample in turn (``topg sdpa topg sdpa ...``, never all of one then all of the other), so
that a neighbour's load drifting during the run hits every variant alike. A ratio is
taken per round (``sdpa / topg`` of the same round) and summarised like any figure.

``Stats`` is the summary of one figure: the median and the spread, p10-p90 when there are
at least 10 samples, min-max below that (a p10 of five samples says little).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

Timer = Callable[[], float]


@dataclasses.dataclass(frozen=True)
class Stats:
    """Median and spread (``lo``-``hi``) of ``n`` samples; ``spread`` names which."""

    median: float
    lo: float
    hi: float
    n: int
    spread: str  # "p10-p90" | "min-max"

    def scaled(self, k: float) -> Stats:
        """The same figure in other units (``k > 0``), e.g. seconds to ms."""
        return Stats(self.median * k, self.lo * k, self.hi * k, self.n, self.spread)

    def inverse(self, k: float = 1.0) -> Stats:
        """``k / x`` of the figure: a time's rate (the ends swap)."""
        return Stats(k / self.median, k / self.hi, k / self.lo, self.n, self.spread)

    def crosses(self, threshold: float) -> bool:
        """True when some samples fall below ``threshold`` and some reach it."""
        return self.lo < threshold <= self.hi

    def overlaps(self, other: Stats) -> bool:
        return self.lo <= other.hi and other.lo <= self.hi

    def fmt(self, spec: str = ".2f", unit: str = "") -> str:
        """``1.23 [1.10-1.41]``: the median, then the spread."""
        if self.n <= 1:
            return f"{self.median:{spec}}{unit} (n=1)"
        return f"{self.median:{spec}}{unit} [{self.lo:{spec}}-{self.hi:{spec}}]"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Stats:
        return cls(float(d["median"]), float(d["lo"]), float(d["hi"]), int(d["n"]), d["spread"])


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``xs``, linear between order statistics (numpy's default)."""
    return _quantile(sorted(xs), q)


def _quantile(s: Sequence[float], q: float) -> float:
    """Linear interpolation between the order statistics of sorted ``s``."""
    k = (len(s) - 1) * q
    i = math.floor(k)
    j = min(i + 1, len(s) - 1)
    return s[i] + (s[j] - s[i]) * (k - i)


def summarize(xs: Sequence[float]) -> Stats:
    """Median and spread of samples: p10-p90 for 10 or more, else min-max."""
    if not xs:
        raise ValueError("no samples")
    s = sorted(xs)
    if len(s) >= 10:
        return Stats(statistics.median(s), _quantile(s, 0.1), _quantile(s, 0.9), len(s), "p10-p90")
    return Stats(statistics.median(s), s[0], s[-1], len(s), "min-max")


@dataclasses.dataclass
class Comparison:
    """Per-call seconds of each variant, one sample per round, in round order."""

    samples: dict[str, list[float]]

    @property
    def names(self) -> list[str]:
        return list(self.samples)

    def stats(self, name: str) -> Stats:
        return summarize(self.samples[name])

    def ms(self, name: str) -> Stats:
        return self.stats(name).scaled(1e3)

    def ratio(self, num: str, den: str) -> Stats:
        """``time(num) / time(den)`` per round: the speed-up of ``den`` over ``num``."""
        return summarize([a / b for a, b in zip(self.samples[num], self.samples[den], strict=True)])

    def per_round(self, name: str, fn: Callable[[float], float]) -> Stats:
        """A figure derived from each round's time, e.g. ``limit_s / t``."""
        return summarize([fn(t) for t in self.samples[name]])


def _sync(device: str | None) -> None:
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize()


def _sample(
    fn: Callable[[], object],
    inner: int,
    timer: Timer,
    device: str | None,
    context: Callable[[], AbstractContextManager] | None = None,
) -> float:
    """Seconds per call over ``inner`` back-to-back calls (inside ``context()``, entered
    and left outside the timed region). ``device="cuda"``: CUDA events around the calls
    on the current stream (the GPU's time, not the host's)."""
    with context() if context else nullcontext():
        if device == "cuda" and torch.cuda.is_available():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3 / inner
        t0 = timer()
        for _ in range(inner):
            fn()
        return (timer() - t0) / inner


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to measure: rounds between ``min_rounds`` and ``max_rounds``, as many
    as fit in ``budget_s``; each sample at least ``min_sample_s`` (tiny ops are called
    many times per sample, so the timer's resolution does not matter)."""

    warmup: int = 2
    min_rounds: int = 5
    max_rounds: int = 25
    budget_s: float = 2.0
    min_sample_s: float = 2e-3
    max_inner: int = 10_000

    @classmethod
    def quick(cls) -> Budget:
        return cls(warmup=1, min_rounds=3, max_rounds=5, budget_s=0.3, min_sample_s=1e-3)

    @classmethod
    def heavy(cls, quick: bool = False) -> Budget:
        """For calls of up to seconds: fewer rounds, spread min-max."""
        return cls(warmup=1, min_rounds=3, max_rounds=5 if quick else 9, budget_s=3.0)


def compare(
    variants: dict[str, Callable[[], object]],
    budget: Budget | None = None,
    *,
    rounds: int | None = None,
    contexts: dict[str, Callable[[], AbstractContextManager]] | None = None,
    device: str | None = None,
    timer: Timer = time.perf_counter,
) -> Comparison:
    """Time every variant in interleaved rounds; see the module docstring.

    ``rounds`` fixes the number of rounds (else the budget decides). ``contexts``: per
    variant, a context every sample of it runs in (e.g. ``torch_topg.enabled``), not
    timed. ``device="cuda"`` times each sample with CUDA events. ``timer`` is for tests.
    """
    b = budget or Budget()
    ctx = contexts or {}
    inner: dict[str, int] = {}
    per_round = 0.0
    for name, fn in variants.items():  # warm-up, then one call timed to calibrate
        with ctx[name]() if name in ctx else nullcontext():
            for _ in range(max(0, b.warmup - 1)):
                fn()
        t1 = max(_sample(fn, 1, timer, device, ctx.get(name)), 1e-9)
        inner[name] = max(1, min(b.max_inner, math.ceil(b.min_sample_s / t1)))
        per_round += inner[name] * t1
    if rounds is None:
        rounds = int(b.budget_s / max(per_round, 1e-9))
        rounds = max(b.min_rounds, min(b.max_rounds, rounds))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            samples[name].append(_sample(fn, inner[name], timer, device, ctx.get(name)))
    return Comparison(samples)


@dataclasses.dataclass(frozen=True)
class Timing:
    """One variant's summary (``bench``), in seconds."""

    stats: Stats

    @property
    def median_s(self) -> float:
        return self.stats.median

    @property
    def min_s(self) -> float:
        return self.stats.lo

    @property
    def runs(self) -> int:
        return self.stats.n

    @property
    def median_ms(self) -> float:
        return self.stats.median * 1e3

    @property
    def median_us(self) -> float:
        return self.stats.median * 1e6


def bench(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    min_runs: int = 5,
    max_runs: int = 1000,
    min_time_s: float = 0.2,
    device: str | None = None,
    timer: Timer = time.perf_counter,
) -> Timing:
    """One callable, each call timed on its own: at least ``min_runs`` calls and
    ``min_time_s``, at most ``max_runs``; ``device="cuda"``: CUDA events around each call.
    For two or more variants use ``compare``."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    start = timer()
    while len(times) < max_runs and (len(times) < min_runs or timer() - start < min_time_s):
        times.append(_sample(fn, 1, timer, device))
    return Timing(summarize(times))


def verdict(ratio: Stats, minimum: float) -> str:
    """A target is met when the ratio's median meets it; a spread holding the target
    makes the row "within noise" either way."""
    met = ratio.median >= minimum
    word = "met" if met else "missed"
    return f"{word}, within noise" if ratio.crosses(minimum) else word
