"""The decision: which candidate runs a call, why, and the kernel at each op's CUDA key.

:meth:`Dispatcher.call` classifies the call (``classes.py``) and looks the decision up per
(op, shape class, features, deterministic mode): a dict lookup once the class was seen.
A new key is decided once, in this order:

1. **forced** (``TOPG_DISPATCH=topg`` or ``attention=sdpa_flash,linear=topg``, or
   :func:`force`): that candidate, or an error saying why it cannot take the call;
2. **deterministic** (``torch_topg.modes.batch_invariant_mode``, the engine's
   ``deterministic=True``): :data:`table.DETERMINISTIC` for the op, never the table;
3. **table**: the entry of (op, class) of the GPU's tuning table, fastest measured first,
   then the candidates it did not measure, in the fixed order;
4. **fixed order** (:func:`table.fixed_order`) when there is no table or no entry.

The first candidate in that order that exists and ``supports`` the call runs; the report
keeps the reasons of those skipped before it. ``reference`` takes every call, so there is
always one. A call that does not run topg's kernel first goes through the op's argument
checks (the Python ones, same words as the native kernels), so a bad call gets the same
error whichever implementation was chosen.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from torch_topg import _native, modes
from torch_topg.ops._registry import OPS
from torch_topg.ops._schemas import DISPATCHED_ON_CUDA, cuda_kernel_op
from torch_topg.ops.dispatch import table as tables
from torch_topg.ops.dispatch.candidates import Candidate, candidates
from torch_topg.ops.dispatch.classes import classify

DeviceInfo = Callable[[torch.device], "tuple[str, tuple[int, int]]"]
PathsFn = Callable[[str], "list[tuple[str, Any]]"]

_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def cuda_device_info(device: torch.device) -> tuple[str, tuple[int, int]]:
    """The GPU's name and compute capability (host queries, no synchronisation)."""
    if device.type != "cuda":
        return f"{device.type} device", (0, 0)
    index = device.index if device.index is not None else torch.cuda.current_device()
    cap = torch.cuda.get_device_capability(index)
    return torch.cuda.get_device_name(index), (int(cap[0]), int(cap[1]))


@dataclass
class Decision:
    """What runs the calls of one (op, shape class, features) key, and why."""

    op: str
    cls: str
    device: str
    candidate: Candidate
    source: str  # "forced" | "deterministic" | "table" | "fixed order"
    why: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    times_us: dict[str, float] | None = None
    config: dict | None = None
    calls: int = 0

    @property
    def checks(self) -> bool:
        """Whether a call runs the op's Python argument checks first (topg's kernel and
        the reference fallback check by themselves)."""
        return self.candidate.name not in ("topg", "reference")

    def describe(self) -> str:
        """Two or more lines: the pick and its source, then each skipped candidate."""
        head = f"{self.op} [{self.cls}] on {self.device}: {self.candidate.name} ({self.source}: {self.why})"
        if self.times_us:
            times = ", ".join(
                f"{n} {t:.1f} us" for n, t in sorted(self.times_us.items(), key=lambda x: x[1])
            )
            head += f"\n    measured: {times}"
        if self.config:
            head += f"\n    config: {self.config}"
        lines = [head] + [f"    skipped {n}: {r}" for n, r in self.skipped]
        lines.append(f"    calls: {self.calls}")
        return "\n".join(lines)


@dataclass
class DispatchReport:
    """Every decision taken in this process (``torch_topg.dispatch_report()``)."""

    decisions: list[Decision]

    def picks(self) -> dict[tuple[str, str], str]:
        """(op, shape class) -> the candidate that ran."""
        return {(d.op, d.cls): d.candidate.name for d in self.decisions}

    def __str__(self) -> str:
        if not self.decisions:
            return (
                "dispatch: no CUDA call of a dispatched op yet "
                f"({', '.join(DISPATCHED_ON_CUDA)}; CPU calls run the CPU kernels)"
            )
        return "\n".join(d.describe() for d in self.decisions)


def parse_forced(spec: str | None) -> dict[str, str]:
    """``"topg"`` -> every op; ``"attention=sdpa_flash,linear=topg"`` -> those ops."""
    out: dict[str, str] = {}
    for part in (spec or "").split(","):
        part = part.strip()
        if not part:
            continue
        op, sep, name = part.partition("=")
        if not sep:
            out["*"] = op
            continue
        if op.strip() not in DISPATCHED_ON_CUDA:
            raise ValueError(
                f"TOPG_DISPATCH: {op.strip()!r} is not a dispatched op ({', '.join(DISPATCHED_ON_CUDA)})"
            )
        out[op.strip()] = name.strip()
    return out


class Dispatcher:
    """Decides and runs; one per process (:data:`DEFAULT`), others in tests.

    Args:
        candidates: op -> candidates (default: :func:`candidates.candidates`).
        device_info: device -> (GPU name, compute capability) (default: CUDA's).
        paths: GPU name -> ``[(source, path)]`` to look for a table in
            (default: :func:`table.table_paths`).
        deterministic: whether the batch-invariant mode is on
            (default: ``torch_topg.modes.batch_invariant_enabled``).
    """

    def __init__(
        self,
        candidates: dict[str, list[Candidate]] | None = None,
        *,
        device_info: DeviceInfo = cuda_device_info,
        paths: PathsFn = tables.table_paths,
        deterministic: Callable[[], bool] = modes.batch_invariant_enabled,
    ) -> None:
        self._given = candidates
        self._candidates: dict[str, dict[str, Candidate]] = {}
        self._device_info = device_info
        self._paths = paths
        self._deterministic = deterministic
        self._cache: dict[tuple, Decision] = {}
        self._tables: dict[tuple, tuple[tables.Table | None, str]] = {}
        self._forced: dict[str, str] | None = None
        self._forced_source = ""
        self._lock = threading.Lock()

    # --- configuration -------------------------------------------------------------

    def candidates(self, op: str) -> dict[str, Candidate]:
        """The candidates of ``op`` by name, in their listed order."""
        if op not in self._candidates:
            given = self._given[op] if self._given is not None else candidates(op)
            self._candidates[op] = {c.name: c for c in given}
        return self._candidates[op]

    def force(self, spec: str | None) -> str | None:
        """Force candidates (``"topg"``, ``"attention=sdpa_flash,linear=topg"``; None: back
        to ``TOPG_DISPATCH``, "" : nothing forced); returns the previous spec."""
        prev = self._forced_spec()
        with self._lock:
            if spec is None:
                self._forced = None
            else:
                self._forced = parse_forced(spec)
                self._forced_source = "forced by torch_topg.ops.dispatch.force"
            self._cache.clear()
        return prev

    def _forced_spec(self) -> str:
        f = self._forced_map()
        return ",".join(v if k == "*" else f"{k}={v}" for k, v in f.items())

    def _forced_map(self) -> dict[str, str]:
        if self._forced is None:
            self._forced = parse_forced(os.environ.get("TOPG_DISPATCH"))
            self._forced_source = "forced by TOPG_DISPATCH"
        return self._forced

    def reset(self) -> None:
        """Forget every decision and loaded table (after a new table was written)."""
        with self._lock:
            self._cache.clear()
            self._tables.clear()

    # --- the table -----------------------------------------------------------------

    def table_for(self, device: torch.device) -> tuple[tables.Table | None, str]:
        """The device's table and a phrase for the report (or None and why not)."""
        key = (device.type, device.index)
        if key not in self._tables:
            self._tables[key] = self._load_table(device)
        return self._tables[key]

    def _load_table(self, device: torch.device) -> tuple[tables.Table | None, str]:
        name, cap = self._device_info(device)
        looked = []
        for source, path in self._paths(name):
            looked.append(str(path))
            if not os.path.exists(path):
                continue
            try:
                t = tables.load_table(path, name, cap, DISPATCHED_ON_CUDA)
            except tables.TableError as exc:
                _warn_once(
                    f"{path}:{exc}",
                    f"torch_topg: tuning table {path} ({source}) refused: {exc}. The fixed "
                    "order of docs/gpu.md runs instead; `python -m torch_topg tune` writes "
                    "a table for this GPU.",
                )
                return None, f"table {path} refused: {exc}"
            return t, f"table {path}"
        return None, f"no tuning table for {name} (looked for {', '.join(looked)})"

    # --- deciding ------------------------------------------------------------------

    def _first(
        self, op: str, order: list[str], args: tuple, kwargs: dict, skipped: list[tuple[str, str]]
    ) -> Candidate:
        cands = self.candidates(op)
        for name in order:
            c = cands.get(name)
            if c is None:
                continue  # e.g. an entry's candidate this torch_topg no longer has
            why = c.unavailable() or c.supports(*args, **kwargs)
            if why is None:
                return c
            skipped.append((name, why))
        return cands["reference"]

    def decide(self, op: str, args: tuple, kwargs: dict, cls: str, deterministic: bool) -> Decision:
        """The decision for a call whose class is ``cls`` (uncached: :meth:`call` caches)."""
        t = next(a for a in args if isinstance(a, torch.Tensor))
        device = t.device
        dev = str(device)
        skipped: list[tuple[str, str]] = []
        forced = self._forced_map()
        name = forced.get(op) or forced.get("*")
        if name is not None:
            c = self.candidates(op).get(name)
            if c is None:
                raise ValueError(
                    f"topg::{op}: {self._forced_source} asks for '{name}', not one of "
                    f"{list(self.candidates(op))}"
                )
            why = c.unavailable() or c.supports(*args, **kwargs)
            if why is not None:
                raise RuntimeError(
                    f"topg::{op}: {self._forced_source} asks for '{name}', which cannot take "
                    f"this call: {why}"
                )
            return Decision(op, cls, dev, c, "forced", self._forced_source)
        if deterministic:
            fixed = tables.DETERMINISTIC[op]
            c = self._first(op, [fixed], args, kwargs, skipped)
            why = f"deterministic=True: always {fixed}, whatever the batch or the table"
            return Decision(op, cls, dev, c, "deterministic", why, skipped)
        table, where = self.table_for(device)
        entry = table.entry(op, cls) if table is not None else None
        order, reason = tables.fixed_order(op, cls)
        if entry is None:
            why = where if table is None else f"{where} has no entry for this class"
            c = self._first(op, order, args, kwargs, skipped)
            return Decision(op, cls, dev, c, "fixed order", f"{why}; {reason}", skipped)
        skipped += [(n, f"excluded by tune: {r}") for n, r in entry.excluded.items()]
        rest = [n for n in order if n not in entry.times_us and n not in entry.excluded]
        c = self._first(op, entry.ranked() + rest, args, kwargs, skipped)
        return Decision(
            op, cls, dev, c, "table", f"{where}, entry picks {entry.pick}", skipped,
            dict(entry.times_us), entry.configs.get(c.name),
        )  # fmt: skip

    def decision(self, op: str, args: tuple, kwargs: dict) -> Decision:
        """The (cached) decision for this call, without running it."""
        try:
            cls, features = classify(op, args, kwargs)
        except Exception:
            OPS[op].check(*args, **kwargs)  # the op's own error for a malformed call
            raise
        det = bool(self._deterministic())
        key = (op, cls, features, det)
        d = self._cache.get(key)
        if d is None:
            OPS[op].check(*args, **kwargs)
            d = self.decide(op, args, kwargs, cls, det)
            with self._lock:
                d = self._cache.setdefault(key, d)
        elif d.checks:
            OPS[op].check(*args, **kwargs)
        return d

    def call(self, op: str, args: tuple, kwargs: dict) -> Any:
        """Run ``topg::<op>(*args, **kwargs)`` on the chosen candidate."""
        d = self.decision(op, args, kwargs)
        d.calls += 1
        c = d.candidate
        if c.tunable:
            return c.run(*args, config=d.config, **kwargs)
        return c.run(*args, **kwargs)

    def report(self) -> DispatchReport:
        with self._lock:
            return DispatchReport(list(self._cache.values()))


#: The process's dispatcher: the kernels at the CUDA keys call it.
DEFAULT = Dispatcher()

#: The ops whose CUDA key runs :data:`DEFAULT` in this process.
INSTALLED: set[str] = set()


#: The library fragment the dispatch registers through: created here, so the dispatcher
#: names this file as where the CUDA kernel of a dispatched op was registered
#: (python/check_cuda_build.py checks it).
_CUDA_LIB: torch.library.Library | None = None


def install() -> list[str]:
    """Register the dispatch at the CUDA key of every ``DISPATCHED_ON_CUDA`` op whose
    topg CUDA kernel (``topg::_cuda_<op>``) the native library registered; returns the ops
    newly installed. Without those kernels (a CPU build, or no native library) nothing is
    registered and the CUDA key stays as it was: the reference fallback runs there, as
    before. CPU keys are never touched."""
    global _CUDA_LIB
    done = []
    for op in DISPATCHED_ON_CUDA:
        if op in INSTALLED or not _native.has_kernel(cuda_kernel_op(op), "CUDA"):
            continue
        if _CUDA_LIB is None:
            _CUDA_LIB = torch.library.Library("topg", "IMPL")

        def kernel(*args: Any, _op: str = op, **kwargs: Any) -> Any:
            return DEFAULT.call(_op, args, kwargs)

        kernel.__name__ = f"{op}_cuda_dispatch"
        _CUDA_LIB.impl(op, kernel, "CUDA")
        INSTALLED.add(op)
        done.append(op)
    return done


def force(spec: str | None) -> str | None:
    """:meth:`Dispatcher.force` of :data:`DEFAULT`."""
    return DEFAULT.force(spec)


@contextlib.contextmanager
def forced(spec: str) -> Iterator[None]:
    """``with forced("topg"):`` the given candidates inside the block (see :func:`force`)."""
    prev = DEFAULT._forced
    prev_source = DEFAULT._forced_source
    DEFAULT.force(spec)
    try:
        yield
    finally:
        with DEFAULT._lock:
            DEFAULT._forced, DEFAULT._forced_source = prev, prev_source
            DEFAULT._cache.clear()


def dispatch_report() -> DispatchReport:
    """Which implementation ran each dispatched op on CUDA, per shape class, and why."""
    return DEFAULT.report()
