"""The engine's side of speculation: plan, propose, roll back, count. ``Speculator`` is
the engine's :class:`~torch_topg.engine.proposer.Proposer` when ``speculative=`` is set.

Per step (``Engine._step``):

1. :meth:`Speculator.plan` before scheduling: for each decoding sequence that may
   speculate (a running sequence with one token left to compute, past its first
   output token, ``speculative`` not turned off on its request, room left under
   ``max_tokens`` and the context), the cap on its proposals (prompt lookup: the
   proposal found); the adaptive rule picks ``seq.num_spec``. The scheduler then counts
   ``1 + num_spec`` tokens for it against the step's budget (and may cut ``num_spec``).
2. :meth:`Speculator.propose` after scheduling (the blocks for every verified position
   exist): ``seq.spec_tokens`` (prompt lookup: already known; a draft: its steps run).
3. The runner computes ``[last token, proposals]`` and returns the logits of all
   ``1 + num_spec`` rows; the engine's sampler draws every row with the key of its
   position (``rejection.py``), and :meth:`Speculator.verify` keeps the leading matches
   (:func:`accepted`) and one more.
4. :meth:`Speculator.rollback` (from ``verify``, before the tokens are appended): ``num_computed`` back to
   the committed positions, blocks that hold only rejected positions returned to the
   pool, statistics; the KV of rejected positions in the kept blocks is overwritten by
   later steps (attention never reads past ``num_computed``). The prefix cache hashes
   only blocks below ``num_computed`` after this, so it never sees a rejected token.
5. :meth:`Speculator.observe_step`: the step's time by its token count (the cost curve).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

from torch_topg.engine.model_runner import PLAN_MAX_TOKENS
from torch_topg.engine.proposer import Proposer
from torch_topg.engine.speculative.adaptive import AdaptiveController, CostModel
from torch_topg.engine.speculative.config import SpeculativeConfig
from torch_topg.engine.speculative.draft import DraftProposer
from torch_topg.engine.speculative.ngram import NgramIndex
from torch_topg.engine.speculative.stats import SpecStats

if TYPE_CHECKING:
    from torch_topg.engine.model_runner import ModelRunner
    from torch_topg.engine.scheduler import Scheduler, SchedulerOutput
    from torch_topg.engine.sequence import Sequence


def accepted(tokens: Seq[int], proposals: Seq[int]) -> int:
    """Leading proposals equal to the drawn tokens (the coupled rule, one sequence)."""
    a = 0
    while a < len(proposals) and tokens[a] == proposals[a]:
        a += 1
    return a


class Speculator(Proposer):
    """Speculation state of one engine (see the module docstring)."""

    def __init__(self, cfg: SpeculativeConfig, runner: ModelRunner, *, max_model_len: int,
                 compile: bool) -> None:  # fmt: skip
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.draft: DraftProposer | None = None
        if cfg.method != "ngram":
            self.draft = DraftProposer(
                runner, method=cfg.method, model=cfg.model if cfg.method == "draft" else None,
                num_layers=cfg.num_layers, compile=compile,
            )  # fmt: skip
        self.ctl = AdaptiveController(
            k_max=cfg.k,
            cost=CostModel(),
            draft_cost=self.draft.cost if self.draft else None,
            adaptive=cfg.adaptive,
            disable_by_batch_size=cfg.disable_by_batch_size,
            # One proposal a probe, prompt lookup included: its whole match (up to k) made
            # a probe at batch 8 cost 30-45% of a step (bf16, measured 2026-12-02), and its
            # acceptance is measured anyway from the proposals it does not use (shadows).
            probe_k=1,
        )
        self.runner = runner
        self.stats = SpecStats()
        self._seq_stats: dict[Sequence, SpecStats] = {}
        self._ngram: dict[Sequence, NgramIndex] = {}
        self._pending: dict[Sequence, list[int]] = {}  # prompt lookup: found before scheduling
        # prompt lookup's acceptance is kept per (sequence, match length): the controller's
        # key of a sequence verifying proposals, until its rollback
        self._lookup_ns = range(cfg.prompt_lookup_min, cfg.prompt_lookup_max + 1)
        self._key: dict[Sequence, tuple[Sequence, int]] = {}
        # the keys of a sequence with an unused proposal still to be scored (set_shadow):
        # checking only those, not every match length, saved ~0.02 ms a batch-8 step
        self._shadowed: dict[Sequence, list[tuple[Sequence, int]]] = {}
        self._steps = 0
        self.time = {"draft_s": 0.0, "profile_s": 0.0}

    # --- start-up ------------------------------------------------------------------
    def warmup(self, max_batch_size: int, max_tokens: int, profile: bool = True) -> None:
        """Compile the draft; seed the cost curve with timed steps of the shapes the rule
        prices: one sequence of ``T = 1 .. k + 1`` tokens, and batches of 2, 4, 8 ..
        sequences of one token each, with one of them verifying ``1 .. k`` proposals (while
        the step fits the decode plan's 16 tokens), and with every one verifying ``k // 2``
        and ``k`` (at most ``max_tokens`` a step).
        Batches are profiled as batches: a batch-8 step reads eight sequences' KV and
        runs on the decode plan up to its 16 tokens, where one sequence of the same
        token count does neither."""
        if self.draft is not None:
            self.draft.warmup()
        if profile:
            t0 = time.perf_counter()
            k = self.cfg.k
            shapes: list[tuple[int, ...]] = [(t,) for t in range(1, k + 2)]
            b = 2
            while b <= max_batch_size:
                # one sequence's 1..k proposals where the step stays on the decode plan
                # (its cost moves by a few percent a token there); beyond, the plain step
                ones = range(k + 1) if b + k <= PLAN_MAX_TOKENS else range(1)
                shapes += [(1 + j,) + (1,) * (b - 1) for j in ones]
                shapes += [(1 + k // 2,) * b, (1 + k,) * b]
                b *= 2
            for T, s in profile_shapes(self.runner, [x for x in shapes if sum(x) <= max_tokens]):
                self.ctl.cost.seed(T, s)
            self.time["profile_s"] = time.perf_counter() - t0

    # --- 1. plan -------------------------------------------------------------------
    def plan(self, scheduler: Scheduler) -> None:
        cands: list[tuple[Sequence, int]] = []
        base = 0
        for seq in scheduler.running:
            seq.num_spec, seq.spec_tokens = 0, []
            base += seq.remaining
            if not self._eligible(seq):
                continue
            req = seq.request
            cap = min(self.cfg.k, req.max_tokens - len(seq.out.token_ids) - 1,
                      self.max_model_len - seq.num_tokens - 1)  # fmt: skip
            if cap <= 0:
                continue
            if self.cfg.method == "ngram":
                idx = self._ngram.get(seq)
                if idx is None:
                    idx = self._ngram[seq] = NgramIndex(
                        self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max
                    )
                shadowed = self._shadowed.pop(seq, None)
                if shadowed:
                    left = [key for key in shadowed if self.ctl.check_shadow(key, seq.token_ids)]
                    if left:
                        self._shadowed[seq] = left
                prop, n = idx.lookup(seq.token_ids, cap)
                self._pending[seq] = prop
                cands.append(((seq, n), len(prop)))
            else:
                cands.append((seq, cap))
        base = min(base, scheduler.max_num_batched_tokens)
        closed = not scheduler.waiting and len(scheduler.running) > 1
        ks = self.ctl.plan(cands, base, closed) if cands else []
        for (key, _), k in zip(cands, ks, strict=True):
            seq = self._seq_of(key)
            seq.num_spec = k
            if self.cfg.method == "ngram":
                prop = self._pending.pop(seq)
                if k:
                    seq.spec_tokens = prop[:k]
                    self._key[seq] = key
                elif prop:
                    self.ctl.set_shadow(key, prop, seq.num_tokens)
                    keys = self._shadowed.setdefault(seq, [])
                    if key not in keys:
                        keys.append(key)
            if k == 0:
                self._stats_of(seq).record(0, 0)
                self.stats.skipped += 1

    @staticmethod
    def _seq_of(key: Sequence | tuple[Sequence, int]) -> Sequence:
        return key[0] if isinstance(key, tuple) else key

    def _eligible(self, seq: Sequence) -> bool:
        req = seq.request
        return (
            seq.remaining == 1
            and seq.num_tokens > seq.prompt_len
            and req.params.speculative
            and (req.params.n == 1 or req.forked)
        )

    # --- 2. propose ----------------------------------------------------------------
    def propose(self, out: SchedulerOutput) -> None:
        work = [(s.seq, s.num_spec) for s in out.scheduled if s.num_spec > 0]
        if self.cfg.method == "ngram" or not work:
            for s in out.scheduled:
                s.seq.spec_tokens = s.seq.spec_tokens[: s.num_spec]
            return
        assert self.draft is not None
        t0 = time.perf_counter()
        props = self.draft.propose(work)
        self.time["draft_s"] += time.perf_counter() - t0
        for seq, _ in work:
            seq.spec_tokens = props[seq]

    # --- 4. verify and roll back -------------------------------------------------
    def verify(self, scheduler: Scheduler, seq: Sequence, drawn: Seq[int]) -> int:
        """The drawn tokens of ``seq``'s verify rows: the leading matches and one more
        are kept; the rest rolled back."""
        n = accepted(drawn, seq.spec_tokens) + 1
        self.rollback(scheduler, seq, n - 1)
        return n

    def rollback(self, scheduler: Scheduler, seq: Sequence, num_accepted: int) -> None:
        """After a verify step of ``seq`` (before its tokens are appended)."""
        k = len(seq.spec_tokens)
        committed = seq.num_tokens  # before the appends: the verified rows start here
        scheduler.rollback(seq, committed + num_accepted)
        self.ctl.observe(self._key.pop(seq, seq), k, num_accepted)
        self.stats.record(k, num_accepted)
        st = self._stats_of(seq)
        st.record(k, num_accepted)
        seq.out.speculative = st.as_dict()
        if self.draft is not None:
            self.draft.verified(seq, num_accepted, k, committed)
        seq.spec_tokens, seq.num_spec = [], 0

    def _stats_of(self, seq: Sequence) -> SpecStats:
        st = self._seq_stats.get(seq)
        if st is None:
            st = self._seq_stats[seq] = SpecStats()
        return st

    # --- 5. measure ----------------------------------------------------------------
    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        self.ctl.observe_step(out.num_tokens, seconds)
        self._steps += 1
        if self._steps % 64 == 0:
            self._prune()

    def _prune(self) -> None:
        """Forget finished sequences."""
        for table in (self._seq_stats, self._ngram, self._key, self._shadowed):
            for seq in [s for s in table if s.finished]:
                del table[seq]
                self.ctl.forget(seq)
                for n in (0, *self._lookup_ns):  # 0: steps that found no match
                    self.ctl.forget((seq, n))
                if self.draft is not None:
                    self.draft.forget(seq)

    def summary(self) -> dict[str, Any]:
        """``engine.stats()["speculative"]``."""
        return {
            "method": self.cfg.method,
            "num_speculative_tokens": self.cfg.k,
            "adaptive": self.cfg.adaptive,
            **self.stats.as_dict(),
            "acceptance_estimate": self.ctl.global_acceptance,
            "cost_curve_s": self.ctl.cost.points(),
            "draft_cost_s": self.draft.cost.points() if self.draft else {},
            "time": dict(self.time),
        }


def profile_shapes(
    runner: ModelRunner, shapes: Seq[Seq[int]], repeats: int = 3
) -> list[tuple[int, float]]:
    """``(T, seconds)`` of a step for each shape (the new tokens of each of its
    sequences, every row sampled as in a verify step; ``T`` their sum), best of
    ``repeats``, on blocks 0.. of the pool (before serving: nothing lives there). Shapes
    that need more blocks than the pool has are left out."""
    bs = runner.block_size
    out: list[tuple[int, float]] = []
    ctx = 8  # a short context before the new tokens
    for shape in shapes:
        items, blk = [], 0
        for i, T in enumerate(shape):
            n = -(-(ctx + T) // bs)
            items.append(([1 + i] * ctx + list(range(1, T + 1)), ctx, T, list(range(blk, blk + n))))
            blk += n
        if blk > runner.num_blocks:
            continue
        batch = runner.pack(items, list(shape))
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.execute(batch)
            best = min(best, time.perf_counter() - t0)
        out.append((sum(shape), best))
    return out


def profile_steps(runner: ModelRunner, sizes: Seq[int], repeats: int = 3) -> dict[int, float]:
    """Seconds of a one-sequence step of ``T`` tokens for each of ``sizes`` (best of
    ``repeats``): the verify step's cost against a one-token step (benchmarks)."""
    return dict(profile_shapes(runner, [(T,) for T in sizes], repeats))
