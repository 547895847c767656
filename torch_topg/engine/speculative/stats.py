"""Speculation figures: per sequence (on its output) and for the engine (``stats()``)."""

from __future__ import annotations

from typing import Any


class SpecStats:
    """Counts of proposals and acceptances.

    A *proposal* is one verify step of one sequence with ``n >= 1`` proposed tokens; it
    emits ``accepted + 1`` tokens. ``acceptance_per_position[i]``: of the proposals that
    reached position ``i`` (had more than ``i`` tokens), the fraction whose token ``i``
    was accepted given that ``0 .. i-1`` were (the conditional rate the adaptive rule
    models). ``mean_accepted_length``: tokens emitted per proposal (accepted + 1, vLLM's
    "mean acceptance length").
    """

    __slots__ = ("accepted", "pos_accepted", "pos_reached", "proposals", "proposed", "skipped")

    def __init__(self) -> None:
        self.proposals = 0
        self.proposed = 0
        self.accepted = 0
        self.skipped = 0  # decode steps of a speculating engine that proposed nothing
        self.pos_reached: list[int] = []
        self.pos_accepted: list[int] = []

    def record(self, proposed: int, accepted: int) -> None:
        """One verify step of one sequence: ``proposed`` tokens, the first ``accepted`` kept."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"SpecStats: accepted {accepted} of {proposed} proposed")
        if proposed == 0:
            self.skipped += 1
            return
        self.proposals += 1
        self.proposed += proposed
        self.accepted += accepted
        while len(self.pos_reached) < proposed:
            self.pos_reached.append(0)
            self.pos_accepted.append(0)
        # position i is reached when 0 .. i-1 were accepted
        for i in range(min(accepted + 1, proposed)):
            self.pos_reached[i] += 1
        for i in range(accepted):
            self.pos_accepted[i] += 1

    def add(self, other: SpecStats) -> None:
        self.proposals += other.proposals
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.skipped += other.skipped
        for i, (r, a) in enumerate(zip(other.pos_reached, other.pos_accepted, strict=True)):
            if i == len(self.pos_reached):
                self.pos_reached.append(0)
                self.pos_accepted.append(0)
            self.pos_reached[i] += r
            self.pos_accepted[i] += a

    def as_dict(self) -> dict[str, Any]:
        n = self.proposals
        return {
            "proposals": n,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "skipped_steps": self.skipped,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "acceptance_per_position": [
                a / r if r else 0.0
                for a, r in zip(self.pos_accepted, self.pos_reached, strict=True)
            ],
            "mean_accepted_length": (self.accepted + n) / n if n else 0.0,
        }
