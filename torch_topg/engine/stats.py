"""The engine's counters (``Engine.stats()`` reads them)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch_topg.engine.scheduler import SchedulerOutput


class EngineStats:
    """Requests, tokens, steps and time, counted by the engine loop."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter(submitted=0, finished=0, aborted=0, failed=0)
        self.tokens: Counter[str] = Counter(generated=0, computed=0)
        self.steps = 0
        self.tokens_per_step = 0
        self.batch_sizes: Counter[int] = Counter()
        self.time: Counter[str] = Counter(schedule_s=0.0, model_s=0.0, sample_s=0.0)

    def count_step(self, out: SchedulerOutput) -> None:
        self.steps += 1
        self.batch_sizes[len(out.scheduled)] += 1
        self.tokens_per_step += out.num_tokens
        self.tokens["computed"] += out.num_tokens
