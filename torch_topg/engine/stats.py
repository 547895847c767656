"""The engine's counters (``Engine.stats()`` reads them)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

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


def engine_stats(engine: Any) -> dict[str, Any]:
    """``Engine.stats()``: what the engine did, one section per subsystem."""
    st = engine._stats
    return {
        "requests": {**st.requests, **engine.scheduler.stats()},
        "tokens": dict(st.tokens),
        "steps": {
            "count": st.steps,
            "batch_sizes": dict(sorted(st.batch_sizes.items())),
            "mean_batch_size": (
                sum(k * v for k, v in st.batch_sizes.items()) / st.steps if st.steps else 0.0
            ),
            "mean_tokens_per_step": st.tokens_per_step / st.steps if st.steps else 0.0,
        },
        "kv": {
            "blocks_total": engine.pool.num_blocks,
            "blocks_used": engine.pool.num_used,
            "block_size": engine.pool.block_size,
            "bytes": engine.runner.kv_bytes,
            **engine.kv.stats(),
        },
        "time": dict(st.time),
        **({"kv_events": engine._kv_feed.stats()} if engine._kv_feed is not None else {}),
        **({"speculative": spec} if (spec := engine.proposer.summary()) is not None else {}),
        "structured": engine.constraints.stats(),
        "decode_plan": {
            "active": engine.runner.plan is not None,
            "kind": "cuda_graphs" if engine.runner.device.type == "cuda" else "plan",
            "reason": engine.runner.plan_reason,
            "steps": engine.runner.plan_steps,
        },
        "compile": {
            "enabled": engine.runner.compiled,
            "compilations": engine.runner.compilations,
            "while_serving": engine.runner.compilations_while_serving,
            "background": engine.runner.background_state,
        },
    }
