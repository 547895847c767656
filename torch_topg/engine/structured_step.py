"""Structured outputs in the engine step: one grammar matcher per constrained sequence,
the step's token masks filled while the forward runs, the sampled tokens accepted.

Per step (``Engine._step``):

1. :meth:`Constraints.start`, after scheduling and proposing, just before the model
   runs: for every scheduled sequence that samples this step and has a grammar, a
   worker thread (one for the engine's life) fills one bitmask row per sampled
   position: the matcher's state after the committed output, then, for a verify step,
   after each proposal in turn (a proposal the matcher refuses stops the walk: its
   row's mask already forbids it, so the sampler cannot draw it and verification
   rejects from there on; the rows past it repeat that row's mask and are never kept).
   The matcher keeps the proposals it took. Only where a core is free of the step's
   threads (more cores in this process's affinity than torch's thread count): else the
   worker would take a core from the forward for as long as it fills, so the rows are
   filled in line at step 2 instead (measured on 2 cores, SmolLM2, 16 streams: a fill
   took 0.54 ms a step beside the forward against 0.18 ms in line, and a thread
   started per step cost 0.5 ms more).
2. :meth:`Constraints.masks`, just before sampling: joins the worker (the time it still
   had to run is the part of the mask's cost the overlap did not hide), or fills the
   rows now, and returns the bitmask rows of the constrained rows; a row the worker had
   no plan for (an ``n > 1`` sample started from the first one's row this step) is
   filled then, on the step's path. The sampler sets the forbidden logits to -inf
   before anything else.
3. :meth:`Constraints.commit` for each sequence's kept tokens (after verification has
   rolled back the KV of rejected proposals): the matcher is rolled back by the
   proposals it took that were not kept, then takes the rest of the kept tokens. A
   matcher that terminates (it took a stop token after a complete match) ends the
   sequence with ``"stop"``; the tokens past that point are dropped.

Why the matcher survives preemption and forks unchanged: it holds only the output
tokens, which a preempted sequence keeps (it recomputes their KV), and a sample of
``n > 1`` starts with no output, the fresh matcher's state.
"""

from __future__ import annotations

import collections
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from torch_topg.engine.structured import GrammarCompiler

if TYPE_CHECKING:
    from torch_topg.engine.scheduler import SchedulerOutput
    from torch_topg.engine.sequence import Sequence

_WINDOW = 4096  # steps kept for the per-step figures


class Constraints:
    """The engine's constrained sequences (see the module docstring). ``compiler`` builds
    the grammars; the engine loop is the one caller of every method."""

    def __init__(self, compiler: GrammarCompiler, overlap: bool | None = None) -> None:
        self.compiler = compiler
        self.words = -(-compiler.vocab_size // 32)
        # fill beside the forward (None: where a core is free of the step's threads)
        self.overlap = spare_core() if overlap is None else overlap
        self._pool: ThreadPoolExecutor | None = None
        self._worker: Future[float] | None = None
        self._pending: list[tuple[Sequence, list[int], int]] | None = None  # filled in line
        self._bitmask: torch.Tensor | None = None
        # seq -> (its first row in the step's bitmask, proposals its matcher took)
        self._plan: dict[Sequence, list[int]] = {}
        self._fill_s = 0.0  # the current step's planned fill time (worker or in line)
        self._sync_s = 0.0  # fills on the step's path (rows without a plan)
        # figures
        self.steps = 0
        self.rows = 0
        self.fill_ms: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self.wait_ms: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self.apply_ms: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self.total_fill_s = 0.0
        self.total_exposed_s = 0.0
        self.terminated = 0

    # -- matchers --------------------------------------------------------------------
    @staticmethod
    def constrained(seq: Sequence) -> bool:
        return seq.request.grammar is not None

    def matcher(self, seq: Sequence) -> Any:
        """``seq``'s matcher (made on first use from its request's compiled grammar)."""
        if seq.matcher is None:
            import xgrammar as xgr

            seq.matcher = xgr.GrammarMatcher(seq.request.grammar)
        return seq.matcher

    # -- 1. before the forward ---------------------------------------------------------
    def start(self, out: SchedulerOutput) -> None:
        """Start filling the masks of this step's constrained sampled rows."""
        self.join()
        self._plan = {}
        self._bitmask = None
        work: list[tuple[Sequence, list[int], int]] = []
        rows = 0
        for s in out.scheduled:
            seq = s.seq
            if not (s.samples and self.constrained(seq)) or seq.finished:
                continue
            props = list(seq.spec_tokens) if s.num_spec else []
            self.matcher(seq)  # made here: the worker only uses them
            work.append((seq, props, rows))
            self._plan[seq] = [rows, 0]
            rows += 1 + len(props)
        if not work:
            return
        self._bitmask = torch.full((rows, self.words), -1, dtype=torch.int32)
        if not self.overlap:
            self._pending = work
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="topg-masks")
        self._worker = self._pool.submit(self._fill, work, self._bitmask)

    def _fill(self, work: list[tuple[Sequence, list[int], int]], bitmask: torch.Tensor) -> float:
        t0 = time.perf_counter()
        for seq, props, first in work:
            self._plan[seq][1] = fill_rows(seq.matcher, props, bitmask, first)
        self._fill_s = time.perf_counter() - t0
        return self._fill_s

    def join(self) -> float:
        """Wait for the worker, or fill the rows left for now; returns the seconds the
        step waited (re-raises the fill's error)."""
        w, self._worker = self._worker, None
        pending, self._pending = self._pending, None
        t0 = time.perf_counter()
        if w is not None:
            w.result()
        elif pending is not None:
            assert self._bitmask is not None
            self._fill(pending, self._bitmask)
        return time.perf_counter() - t0 if w is not None or pending is not None else 0.0

    def close(self) -> None:
        """End the worker thread (the engine's shutdown)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- 2. before sampling ----------------------------------------------------------
    def masks(
        self, rows: list[tuple[Sequence, list[int]]]
    ) -> tuple[torch.Tensor, list[int]] | None:
        """The bitmask rows of the step's constrained rows and their indices in ``rows``
        (``(seq, proposals before the row)``, the sampler's rows); None: none."""
        waited = self.join()
        planned = self._bitmask is not None
        idx: list[int] = []
        take: list[int] = []
        extra: list[tuple[int, Sequence]] = []
        for i, (seq, drafted) in enumerate(rows):
            if not self.constrained(seq):
                continue
            plan = self._plan.get(seq)
            idx.append(i)
            if plan is None:
                extra.append((len(take), seq))
                take.append(-1)
            else:
                take.append(plan[0] + len(drafted))
        if not idx:
            return None
        self._sync_s = 0.0
        if planned:
            assert self._bitmask is not None
            bitmask = self._bitmask[torch.tensor([max(t, 0) for t in take])]
        else:
            bitmask = torch.full((len(idx), self.words), -1, dtype=torch.int32)
        if extra:
            t0 = time.perf_counter()
            for j, seq in extra:
                fill_rows(self.matcher(seq), [], bitmask, j)
            self._sync_s = time.perf_counter() - t0
        self._record(waited, len(idx), planned)
        return bitmask, idx

    def _record(self, waited: float, rows: int, planned: bool) -> None:
        fill = (self._fill_s if planned else 0.0) + self._sync_s
        self.steps += 1
        self.rows += rows
        self.fill_ms.append(fill * 1e3)
        exposed = min(waited, self._fill_s if planned else 0.0) + self._sync_s
        self.wait_ms.append(exposed * 1e3)
        self.total_fill_s += fill
        self.total_exposed_s += exposed
        self._fill_s = 0.0

    def applied(self, seconds: float) -> None:
        """The sampler's time applying the step's masks (on the step's path)."""
        self.apply_ms.append(seconds * 1e3)

    # -- 3. after verification -------------------------------------------------------
    def commit(self, seq: Sequence, tokens: list[int]) -> tuple[int, str | None]:
        """``seq``'s kept tokens: how many of them stand, and ``"stop"`` when the grammar
        has ended (the matcher terminated, or refused a token after a complete match),
        ``"error"`` when it refused a token before one (no allowed token was left), else
        None. ``tokens[:-1]`` are the proposals the step accepted."""
        m = self.matcher(seq)
        plan = self._plan.pop(seq, None)
        took = plan[1] if plan is not None else 0
        held = min(took, len(tokens) - 1)  # kept tokens the matcher already holds
        if took > held:
            m.rollback(took - held)
        if m.is_terminated():
            self.terminated += 1
            return held, "stop"
        n = held
        for tok in tokens[held:]:
            if not m.accept_token(tok):
                return n, "stop" if m.is_completed() else "error"
            n += 1
            if m.is_terminated():
                self.terminated += 1
                return n, "stop"
        return n, None

    # -- figures -----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``engine.stats()["structured"]``: compile cache; per step with constrained rows
        the mask fill time (mean, p90), the part of it the step waited for (not hidden by
        the overlap with the forward) and the sampler's time applying the masks."""
        fill = sorted(self.fill_ms)
        p90 = fill[min(len(fill) - 1, int(0.9 * len(fill)))] if fill else 0.0
        mean = sum(fill) / len(fill) if fill else 0.0
        hidden = 1.0 - self.total_exposed_s / self.total_fill_s if self.total_fill_s else 0.0
        return {
            **self.compiler.stats(),
            "steps": self.steps,
            "rows": self.rows,
            "terminated": self.terminated,
            "mask_ms_mean": mean,
            "mask_ms_p90": p90,
            "mask_exposed_ms_mean": sum(self.wait_ms) / len(self.wait_ms) if self.wait_ms else 0.0,
            "mask_hidden_fraction": max(0.0, hidden),
            "apply_ms_mean": sum(self.apply_ms) / len(self.apply_ms) if self.apply_ms else 0.0,
        }


def spare_core() -> bool:
    """Whether this process may run on more cores than torch's threads use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call (macOS, Windows)
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


def fill_rows(matcher: Any, props: list[int], bitmask: torch.Tensor, first: int) -> int:
    """Fill ``bitmask[first]`` from ``matcher``'s state, then for each proposal that the
    matcher accepts the next row; rows after a refused proposal (or a terminated matcher)
    repeat the last filled one. Returns the proposals the matcher took (it keeps them)."""
    matcher.fill_next_token_bitmask(bitmask, first)
    took = 0
    for j, tok in enumerate(props):
        if matcher.is_terminated() or not matcher.accept_token(tok):
            bitmask[first + j + 1 : first + len(props) + 1] = bitmask[first + j]
            break
        took += 1
        if matcher.is_terminated():
            bitmask[first + j + 1 : first + len(props) + 1] = bitmask[first + j]
            break
        matcher.fill_next_token_bitmask(bitmask, first + j + 1)
    return took
