"""Timing: warm-up, interleaved rounds, the median and the spread of figures and ratios.

``compare({"topg": f, "sdpa": g})`` calibrates each variant (how many calls make one
sample of at least ``min_sample_s``), then runs rounds in which every variant takes one
sample in turn (``topg sdpa topg sdpa ...``, never all of one then all of the other), so
that a neighbour's load drifting during the run hits every variant alike. A ratio is
taken per round (``sdpa / topg`` of the same round) and summarised like any figure.

``Stats`` is the summary of one figure: the median and the spread, p10-p90 when there are
at least 10 samples, min-max below that (a p10 of five samples says little).

Clocks: on the CPU a sample is the host's ``perf_counter`` around the calls; on a GPU
(``device="cuda"``, or by default when the callables hold CUDA tensors) it is a pair of
CUDA events around them, and a round synchronises once, after its last sample, so the
GPU's queue is not drained between the variants of a round. ``Stopwatch`` times one-off
events (a prefill that fills a cache, a request's first token) on the same clocks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

import torch

Timer = Callable[[], float]
T = TypeVar("T")


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


class HostClock:
    """The host's clock: a mark is ``timer()``. With ``synchronize`` (``wall_clock``),
    each mark first waits for the device, so a sample is the wall time of everything the
    calls started, on any stream or thread."""

    def __init__(
        self, timer: Timer = time.perf_counter, synchronize: Callable[[], None] | None = None
    ) -> None:
        self.timer = timer
        self._synchronize = synchronize

    def mark(self) -> float:
        if self._synchronize is not None:
            self._synchronize()
        return self.timer()

    def sync(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


def wall_clock(
    device: str | torch.device | None = None, timer: Timer = time.perf_counter
) -> HostClock:
    """The host's clock, synchronising a CUDA ``device`` at each mark: for work that CUDA
    events on the current stream would miss (copies on their own stream from a host
    thread) or for the wall time of a whole generation."""
    sync = torch.cuda.synchronize if timing_device(device) == "cuda" else None
    return HostClock(timer, sync)


class CudaClock:
    """The GPU's clock: a mark is a CUDA event recorded on the current stream
    (``torch.cuda.Event(enable_timing=True)``), so a sample is the GPU's time between two
    marks, not the host's time to launch the work. ``seconds`` is valid after ``sync()``,
    which a round calls once, after all its samples. ``event`` and ``synchronize`` are
    for tests."""

    def __init__(
        self,
        event: Callable[[], Any] | None = None,
        synchronize: Callable[[], None] | None = None,
    ) -> None:
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._synchronize = synchronize or torch.cuda.synchronize

    def mark(self) -> Any:
        e = self._event()
        e.record()
        return e

    def sync(self) -> None:
        self._synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) * 1e-3  # events measure ms


Clock = HostClock | CudaClock


def tensors_of(fn: object) -> list[torch.Tensor]:
    """The tensors a callable holds: its closure's cells, a ``functools.partial``'s
    arguments, a bound method's object (``x.sum``), one level deep."""
    held: list[object] = []
    if isinstance(fn, functools.partial):
        held += [fn.func, *fn.args, *fn.keywords.values()]
        fn = fn.func
    held.append(getattr(fn, "__self__", None))
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    out: list[torch.Tensor] = []
    for x in held:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out += [y for y in x if isinstance(y, torch.Tensor)]
    return out


def timing_device(device: str | torch.device | None, fns: Iterable[object] = ()) -> str:
    """Which clock times ``fns``: ``"cuda"`` or ``"cpu"``. An explicit ``device`` wins
    (its type: ``"cuda:1"`` is ``"cuda"``); else ``"cuda"`` when a tensor the callables
    hold (``tensors_of``) is on a CUDA device, else ``"cpu"``."""
    if device is not None:
        return "cuda" if torch.device(device).type == "cuda" else "cpu"
    for fn in fns:
        if any(t.device.type == "cuda" for t in tensors_of(fn)):
            return "cuda"
    return "cpu"


def make_clock(
    device: str | torch.device | None,
    fns: Iterable[object] = (),
    timer: Timer = time.perf_counter,
    cuda_available: Callable[[], bool] = torch.cuda.is_available,
) -> Clock:
    """The clock for ``timing_device(device, fns)``; CUDA events need a usable GPU
    (``ValueError`` otherwise: a GPU figure must not be a host figure in disguise)."""
    if timing_device(device, fns) == "cuda":
        if not cuda_available():
            raise ValueError("CUDA timing asked for, but torch sees no usable CUDA device")
        return CudaClock()
    return HostClock(timer)


def _timed(
    fn: Callable[[], object],
    inner: int,
    clock: Clock,
    context: Callable[[], AbstractContextManager] | None = None,
) -> tuple[Any, Any]:
    """``inner`` back-to-back calls between two marks (inside ``context()``, entered and
    left outside the marks)."""
    with context() if context else nullcontext():
        start = clock.mark()
        for _ in range(inner):
            fn()
        end = clock.mark()
    return start, end


def _sample(
    fn: Callable[[], object],
    inner: int,
    clock: Clock,
    context: Callable[[], AbstractContextManager] | None = None,
) -> float:
    """Seconds per call over ``inner`` back-to-back calls, one sample on its own."""
    start, end = _timed(fn, inner, clock, context)
    clock.sync()
    return clock.seconds(start, end) / inner


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
    device: str | torch.device | None = None,
    timer: Timer = time.perf_counter,
    clock: Clock | None = None,
) -> Comparison:
    """Time every variant in interleaved rounds; see the module docstring.

    ``rounds`` fixes the number of rounds (else the budget decides). ``contexts``: per
    variant, a context every sample of it runs in (e.g. ``torch_topg.enabled``), not
    timed. ``device``: whose clock (``timing_device``): on CUDA, each sample is a pair of
    CUDA events and a round synchronises once, after its last sample; by default CUDA
    when the variants hold CUDA tensors. ``timer`` / ``clock`` are for tests.
    """
    b = budget or Budget()
    ctx = contexts or {}
    clock = clock or make_clock(device, variants.values(), timer)
    inner: dict[str, int] = {}
    per_round = 0.0
    for name, fn in variants.items():  # warm-up, then one call timed to calibrate
        with ctx[name]() if name in ctx else nullcontext():
            for _ in range(max(0, b.warmup - 1)):
                fn()
        t1 = max(_sample(fn, 1, clock, ctx.get(name)), 1e-9)
        inner[name] = max(1, min(b.max_inner, math.ceil(b.min_sample_s / t1)))
        per_round += inner[name] * t1
    if rounds is None:
        rounds = int(b.budget_s / max(per_round, 1e-9))
        rounds = max(b.min_rounds, min(b.max_rounds, rounds))
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        marks = {
            name: _timed(fn, inner[name], clock, ctx.get(name)) for name, fn in variants.items()
        }
        clock.sync()  # once per round: the GPU runs the round's samples back to back
        for name, (start, end) in marks.items():
            samples[name].append(clock.seconds(start, end) / inner[name])
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
    device: str | torch.device | None = None,
    timer: Timer = time.perf_counter,
    clock: Clock | None = None,
) -> Timing:
    """One callable, each call timed on its own: at least ``min_runs`` calls and
    ``min_time_s`` (host time), at most ``max_runs``; ``device`` as in ``compare`` (on
    CUDA, events around each call). For two or more variants use ``compare``."""
    clock = clock or make_clock(device, [fn], timer)
    for _ in range(warmup):
        fn()
    clock.sync()
    times: list[float] = []
    start = timer()
    while len(times) < max_runs and (len(times) < min_runs or timer() - start < min_time_s):
        times.append(_sample(fn, 1, clock))
    return Timing(summarize(times))


class Stopwatch:
    """Samples of one-off events that are no repeatable call: a prefill that fills a
    cache, the first token of a request, a compile. ``with sw.lap(): ...`` adds one sample
    (seconds); ``sw.stats()`` / ``sw.ms()`` summarise them like ``compare``'s figures.
    ``device`` as in ``compare`` (no callables to look into: CUDA only when asked);
    each lap synchronises once, at its end."""

    def __init__(
        self,
        device: str | torch.device | None = None,
        *,
        timer: Timer = time.perf_counter,
        clock: Clock | None = None,
    ) -> None:
        self.clock = clock or make_clock(device, (), timer)
        self.samples: list[float] = []

    @contextlib.contextmanager
    def lap(self) -> Iterator[None]:
        start = self.clock.mark()
        yield
        end = self.clock.mark()
        self.clock.sync()
        self.samples.append(self.clock.seconds(start, end))

    @property
    def last(self) -> float:
        """The latest sample, seconds."""
        return self.samples[-1]

    def stats(self) -> Stats:
        return summarize(self.samples)

    def ms(self) -> Stats:
        return self.stats().scaled(1e3)


def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """``fn(*args, **kwargs)`` once on the host's clock: its result and the seconds it
    took (a one-off: a model load, a whole run). For repeated calls use ``compare``."""
    sw = Stopwatch()
    with sw.lap():
        out = fn(*args, **kwargs)
    return out, sw.last


def verdict(ratio: Stats, minimum: float) -> str:
    """A target is met when the ratio's median meets it; a spread holding the target
    makes the row "within noise" either way."""
    met = ratio.median >= minimum
    word = "met" if met else "missed"
    return f"{word}, within noise" if ratio.crosses(minimum) else word
