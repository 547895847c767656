"""An op benchmark's row: its variants timed side by side, and their physical limit.

A family module of the op benchmark (``python/benchmarks/families/<family>.py``) exposes ``run(quick: bool) -> list[Row]`` and
builds each row with ``measure(...)``: the variants (``"topg"`` first, then the
baselines) are timed by ``torch_topg.bench.compare`` in interleaved rounds, and every
figure and ratio is a ``Stats`` (median and spread).

Limits:

* memory (``dram_bytes``): the bytes that must come from DRAM (every input read once;
  outputs are written, not read, and are not counted: the probe measures reads, and a
  core's write-backs overlap its reads, so counting writes at the read bandwidth
  doubled an in-place op's bytes) over the read bandwidth. Only compared when they do
  come from DRAM: the working set is at least ``DRAM_FACTOR x`` the LLC, or the row
  rotates input sets that together are (``Rotation``); otherwise the row says "in
  cache" and has no "% of limit". The bandwidth probe (``read_probe``) runs in every
  round of such a row, and each round's fraction uses that round's bandwidth: the
  machine's load moves the bandwidth during a run.
* compute (``flops``): "of best", topg's rate over the rate of the variant that was
  fastest on this shape in this run (per round: its time over topg's), and "of peak",
  topg's rate over the machine's theoretical fp32 peak
  (``torch_topg.bench.theoretical_peak``; its assumptions are printed with the table).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from torch_topg.bench import (
    DRAM_FACTOR,
    Budget,
    Stats,
    cold_copies,
    compare,
    gemm_stats,
    llc_bytes,
    read_probe,
    summarize,
    theoretical_peak,
    verdict,
)

__all__ = ["Rotation", "Row", "measure"]

MiB = 1 << 20
PROBE = "read-bandwidth probe"


@dataclasses.dataclass
class Row:
    family: str
    op: str
    case: str  # sizes, e.g. "B=1 S=512 Hq=16 Hkv=4 D=64 causal"
    dtype: str  # "fp32" | "bf16" | "fp16"
    figures: dict[str, Stats]  # ms per call; "topg" first, then the baselines
    # speed-up of topg over each baseline (their time / topg's, per round), and where a
    # limit applies "limit" (fraction of the DRAM limit) or "of best" / "of peak" (GEMM)
    ratios: dict[str, Stats]
    regime: str = ""  # "DRAM" | "cold: ..." | "in cache (...)" | "compute"
    limit_ms: float | None = None  # the physical-limit time (DRAM bytes or best GEMM)
    limit_kind: str = ""  # "read bw" | "gemm"
    # the target: (ratio name, minimum), e.g. ("sdpa", 1.2): topg >= 1.2x faster
    # than sdpa; ("limit", 0.8): topg reaches >= 80% of the DRAM limit; ("limit <name>",
    # 0.8): the variant <name> does (measure's limit_for)
    target: tuple[str, float] | None = None
    note: str = ""
    read_bw: Stats | None = None  # bytes/s, the probe in this row's own rounds
    flops: float | None = None  # per call, for a compute-bound row

    @property
    def key(self) -> str:
        return f"{self.op} | {self.case} | {self.dtype}"

    @property
    def topg(self) -> Stats:
        return self.figures["topg"]

    @property
    def baselines(self) -> list[str]:
        return [n for n in self.figures if n != "topg"]

    @property
    def verdict(self) -> str | None:
        if self.target is None:
            return None
        name, minimum = self.target
        if name not in self.ratios:
            return "not measured"
        return verdict(self.ratios[name], minimum)

    @property
    def ok(self) -> bool | None:
        """Met: the ratio's median reaches the target (noise or not)."""
        v = self.verdict
        return None if v is None else v.startswith("met")

    def to_dict(self) -> dict:
        return {
            "key": self.key,
            "unit": "ms",
            "family": self.family,
            "op": self.op,
            "case": self.case,
            "dtype": self.dtype,
            "figures": {k: v.to_dict() for k, v in self.figures.items()},
            "ratios": {k: v.to_dict() for k, v in self.ratios.items()},
            "regime": self.regime,
            "limit_ms": self.limit_ms,
            "limit_kind": self.limit_kind,
            "target": list(self.target) if self.target else None,
            "verdict": self.verdict,
            "note": self.note,
            "read_bw": self.read_bw.to_dict() if self.read_bw else None,
            "flops": self.flops,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Row:
        return cls(
            d["family"], d["op"], d["case"], d["dtype"],
            {k: Stats.from_dict(v) for k, v in d["figures"].items()},
            {k: Stats.from_dict(v) for k, v in d["ratios"].items()},
            d.get("regime", ""), d.get("limit_ms"), d.get("limit_kind", ""),
            tuple(d["target"]) if d.get("target") else None, d.get("note", ""),
            Stats.from_dict(d["read_bw"]) if d.get("read_bw") else None, d.get("flops"),
        )  # fmt: skip


class Rotation:
    """``sets`` input sets used in turn, one per call (``next()``): with ``cold=True``
    enough of them that together they are ``DRAM_FACTOR x`` the LLC, so each call finds
    its inputs evicted; with ``cold=False`` one set (it stays in whatever cache holds
    it)."""

    def __init__(self, make: Callable[[int], tuple], working_set: int, cold: bool):
        self.working_set = working_set
        self.n = cold_copies(working_set) if cold else 1
        self.sets = [make(i) for i in range(self.n)]
        self._it = itertools.cycle(self.sets)

    def next(self) -> tuple:
        return next(self._it)

    @property
    def first(self) -> tuple:
        return self.sets[0]


def _budget(quick: bool, heavy: bool) -> Budget:
    if heavy:
        return Budget.heavy(quick)
    return Budget.quick() if quick else Budget()


def size(nbytes: float) -> str:
    return f"{nbytes / MiB:.0f} MiB" if nbytes >= MiB else f"{nbytes / 1024:.0f} KiB"


def regime_of(working_set: int, sets: int = 1) -> str:
    """ "DRAM", "cold: ..." (rotated input sets) or "in cache (...)"; see the module."""
    llc = llc_bytes()[0]
    if sets > 1 and sets * working_set >= DRAM_FACTOR * llc:
        return f"cold: {sets} sets of {size(working_set)} rotated"
    if working_set >= DRAM_FACTOR * llc:
        return "DRAM"
    return f"in cache ({size(working_set)})"


def measure(
    family: str,
    op: str,
    case: str,
    dtype: str,
    variants: dict[str, Callable[[], object]],
    *,
    quick: bool,
    heavy: bool = False,
    target: tuple[str, float] | None = None,
    dram_bytes: float | None = None,
    working_set: int | None = None,
    rotation: Rotation | None = None,
    flops: float | None = None,
    note: str = "",
    budget: Budget | None = None,
    contexts: dict | None = None,
    limit_for: tuple[str, ...] = (),
) -> Row:
    """Time ``variants`` (``"topg"`` first) side by side and build the row.

    ``dram_bytes``: the bytes one call must move to or from DRAM; ``working_set``: the
    bytes one call touches (default ``dram_bytes``); ``rotation``: the inputs' rotation,
    if any. ``flops``: for a compute-bound row. ``heavy``: calls of up to seconds;
    ``budget`` overrides the rounds; ``contexts`` as in ``torch_topg.bench.compare``.
    ``limit_for``: other variants whose fraction of the DRAM limit is reported too, as the
    ratio ``"limit <name>"`` (per round, against that round's probe, like topg's).
    """
    assert next(iter(variants)) == "topg", "topg is the first variant"
    regime, probe_bytes = "", 0
    if dram_bytes is not None:
        ws = int(working_set or (rotation.working_set if rotation else dram_bytes))
        regime = regime_of(ws, rotation.n if rotation else 1)
        if not regime.startswith("in cache"):  # the probe runs in every round
            probe, probe_bytes = read_probe()
            variants = {**variants, PROBE: probe}
    cmp = compare(variants, budget or _budget(quick, heavy), contexts=contexts)
    names = [n for n in variants if n != PROBE]
    figures = {name: cmp.ms(name) for name in names}
    ratios = {name: cmp.ratio(name, "topg") for name in names if name != "topg"}
    row = Row(family, op, case, dtype, figures, ratios, regime, target=target, note=note)
    if probe_bytes:
        # each round: the time of the row's bytes at that round's bandwidth, over topg's
        # (and over each limit_for variant's, as "limit <name>")
        for name in ("topg", *limit_for):
            pairs = zip(cmp.samples[PROBE], cmp.samples[name], strict=True)
            key = "limit" if name == "topg" else f"limit {name}"
            row.ratios[key] = summarize([dram_bytes * tp / probe_bytes / t for tp, t in pairs])
        row.read_bw = cmp.stats(PROBE).inverse(float(probe_bytes))
        row.limit_ms = dram_bytes / row.read_bw.median * 1e3
        row.limit_kind = "read bw"
    if flops is not None:
        best = min(names, key=lambda n: cmp.stats(n).median)
        peak = theoretical_peak(measured_flops=gemm_stats().hi)["fp32_flops"]
        row.regime, row.limit_kind, row.flops = "compute", "gemm", flops
        row.limit_ms = cmp.ms(best).median
        row.ratios["of best"] = cmp.ratio(best, "topg")  # per round: best's time / topg's
        if peak > 0:
            row.ratios["of peak"] = cmp.per_round("topg", lambda t: flops / t / peak)
        row.note = (row.note + "; " if row.note else "") + f"best: {best}"
    return row


def single(family: str, op: str, case: str, dtype: str, ms: dict[str, float], **kw) -> Row:
    """A row from single measurements (n=1), e.g. a one-shot run in a fresh process."""
    figures = {k: Stats(v, v, v, 1, "n=1") for k, v in ms.items()}
    ratios = {
        k: Stats(v / ms["topg"], v / ms["topg"], v / ms["topg"], 1, "n=1")
        for k, v in ms.items()
        if k != "topg"
    }
    return Row(family, op, case, dtype, figures, ratios, **kw)
