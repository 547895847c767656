"""The seam between the engine step and speculative decoding.

The step asks a :class:`Proposer` five things, in this order; the base class answers
each with nothing to do, so an engine without speculation runs the same step and never
imports :mod:`torch_topg.engine.speculative` (its ``Speculator`` is the one subclass,
built only when ``speculative=`` is set):

1. :meth:`plan` before scheduling: how many proposals each decoding sequence may get
   (``seq.num_spec``; the scheduler counts ``1 + num_spec`` tokens and may cut it);
2. :meth:`propose` after scheduling: the proposals themselves (``seq.spec_tokens``);
3. the runner computes ``1 + num_spec`` rows for such a sequence and the sampler draws
   each; :meth:`verify` says how many drawn tokens are kept (rolling back the KV of the
   rejected positions before any token is appended);
4. :meth:`observe_step`: the step's duration by its token count;
5. :meth:`summary`: ``engine.stats()["speculative"]`` (None: no such section).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_topg.engine.scheduler import Scheduler, SchedulerOutput
    from torch_topg.engine.sequence import Sequence


class Proposer:
    """No proposals: the plain engine step."""

    def warmup(self, max_batch_size: int, max_tokens: int) -> None:
        """Before serving (measure what the proposals' rule needs)."""

    def plan(self, scheduler: Scheduler) -> None:
        """Before scheduling: set ``seq.num_spec`` of the sequences that may speculate."""

    def propose(self, out: SchedulerOutput) -> None:
        """After scheduling: fill ``seq.spec_tokens`` of the scheduled sequences."""

    def verify(self, scheduler: Scheduler, seq: Sequence, drawn: Seq[int]) -> int:
        """``drawn``: one token per verified row of ``seq`` (``len(seq.spec_tokens) + 1``).
        Returns how many to keep, after rolling back the rest. Called only for sequences
        with proposals."""
        raise AssertionError("Proposer.verify: a sequence with proposals and no proposer")

    def observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """After the step: its duration."""

    def summary(self) -> dict[str, Any] | None:
        """``engine.stats()["speculative"]``; None: the section is left out."""
        return None
