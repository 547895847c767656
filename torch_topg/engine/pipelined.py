"""The engine step with micro-batches in flight (pipeline parallelism, ``engine/pp.py``).

With ``nnodes`` stages, one plain step at a time would leave every stage idle while the
others compute. Here the engine keeps up to ``depth`` (= ``nnodes``) steps in flight:

1. while fewer than ``depth`` are in flight, schedule a micro-batch from the sequences
   not in flight (:attr:`Scheduler.busy`), at most ``ceil(sequences / depth)`` of them so
   the running ones spread evenly over the micro-batches, and *dispatch* it: node 0 runs
   its layers and sends the hidden states on, and is free for the next micro-batch while
   the other nodes run theirs;
2. *collect* the oldest micro-batch's logits from the last stage, then sample, update and
   emit exactly as a plain step does (``Engine._finish_step``), which frees its
   sequences for the next micro-batch.

A sequence is in at most one micro-batch at a time, so its tokens are the same as with
one process. Stages run the micro-batches in the order they were dispatched, which is
also what makes it safe to free the blocks of a request aborted while in flight: any
later owner's writes reach every stage after the aborted step's.

A failed dispatch or collect fails the requests of that micro-batch (the runner is then
broken and every later one fails the same way, with its reason).
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch_topg.engine.scheduler import SchedulerOutput


class PipelinedSteps:
    """The engine loop's step when ``runner.pipeline_depth > 1``."""

    def __init__(self, engine: Any, depth: int) -> None:
        self.engine = engine
        self.depth = depth
        self.inflight: deque[tuple[SchedulerOutput, list[Any], Any, float]] = deque()

    def step(self) -> None:
        """Fill the pipeline, then complete its oldest micro-batch."""
        e, sch = self.engine, self.engine.scheduler
        while len(self.inflight) < self.depth:
            t0 = time.perf_counter()
            free = len(sch.running) - len(sch.busy) + len(sch.waiting)
            share = -(-(len(sch.running) + len(sch.waiting)) // self.depth)
            out = sch.schedule(max_seqs=max(1, min(free, share)))
            t1 = time.perf_counter()
            e._stats.time["schedule_s"] += t1 - t0
            if not out.scheduled:
                if not self.inflight:
                    sch.wait_for_loads()
                break
            try:
                batch, samples = e._pack(out)
                ticket = e.runner.dispatch(batch)
            except Exception as err:
                self._fail(out, err)
                continue
            sch.busy.update(s.seq for s in out.scheduled)
            self.inflight.append((out, samples, ticket, t1))
        if not self.inflight:
            return
        out, samples, ticket, t1 = self.inflight.popleft()
        sch.busy.difference_update(s.seq for s in out.scheduled)
        try:
            rows = e._rows(out, e.runner.collect(ticket), samples)
        except Exception as err:
            self._fail(out, err)
            return
        # structured outputs: masks filled now (one micro-batch's fill at a time)
        e.constraints.start(out)
        e._finish_step(out, rows, t1)

    def _fail(self, out: SchedulerOutput, err: BaseException) -> None:
        for s in out.scheduled:
            if not s.seq.finished:
                self.engine._fail(s.seq.request, err)
