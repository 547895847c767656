"""Prometheus metrics of the server (``GET /metrics``, prometheus-client's text format).

Two sources: the per-request outputs (finish reasons, token counts, TTFT, inter-token
and end-to-end latency), observed by the server when a request ends; and
``engine.stats()`` (running / waiting requests, KV blocks, steps, batch sizes), read at
every scrape by a collector, so those are the engine's own numbers at that moment.
Each app has its own registry: several apps (tests) in one process do not collide.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from torch_topg.engine import Engine, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """The registry and the per-request instruments; ``engine`` is read at scrape time
    (None while the model loads: the engine metrics are then absent)."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        r = self.registry = CollectorRegistry()
        self.http = Counter(
            "topg_http_requests", "HTTP requests by endpoint and status code",
            ["endpoint", "status"], registry=r,
        )  # fmt: skip
        self.finished = Counter(
            "topg_request_finished",
            "Samples (choices) finished, by finish_reason (n=2 counts 2)",
            ["finish_reason"], registry=r,
        )  # fmt: skip
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        self.prompt_tokens = Counter("topg_prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter("topg_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter(
            "topg_cached_prompt_tokens", "Prompt tokens read from the KV cache", registry=r
        )
        self.ttft = Histogram(
            "topg_time_to_first_token_seconds",
            "Time from arrival at the engine to a sample's first token",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "topg_inter_token_latency_seconds",
            "Time between two consecutive tokens of a sample (every gap)",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "topg_time_per_output_token_seconds",
            "A sample's mean time per output token after its first",
            buckets=_LATENCY, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "topg_e2e_request_latency_seconds",
            "Time from the HTTP request's arrival to its last token",
            buckets=_REQUEST, registry=r,
        )  # fmt: skip
        r.register(_EngineCollector(engine))

    def observe(self, outputs: list[RequestOutput], start: float) -> None:
        """A finished request: its prompts' outputs and its arrival (``perf_counter``)."""
        self.e2e.observe(time.perf_counter() - start)
        for out in outputs:
            self.prompt_tokens.inc(out.prompt_tokens)
            self.generation_tokens.inc(out.completion_tokens)
            self.cached_tokens.inc(out.cached_prompt_tokens)
            for sample in out.outputs:
                self.finished.labels(sample.finish_reason or "abort").inc()
                times = sample.token_times
                if not times:
                    continue
                self.ttft.observe(times[0])
                for a, b in itertools.pairwise(times):
                    self.itl.observe(b - a)
                if len(times) > 1:
                    self.tpot.observe((times[-1] - times[0]) / (len(times) - 1))

    def aborted(self, samples: int) -> None:
        """A request given up before its output came back (client gone)."""
        self.finished.labels("abort").inc(samples)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """``engine.stats()`` as metrics, read at each scrape."""

    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self._engine = engine

    def describe(self) -> list[Metric]:
        return []  # names depend on the engine being there; no registration-time check

    def collect(self) -> Iterator[Metric]:
        engine = self._engine()
        if engine is None:
            return
        s = _stats(engine)
        req, kv, steps = s["requests"], s["kv"], s["steps"]
        yield _gauge("topg_num_requests_running", "Sequences in the running batch", req["running"])
        yield _gauge("topg_num_requests_waiting", "Sequences waiting for admission", req["waiting"])
        c = CounterMetricFamily(
            "topg_engine_requests", "Engine requests by state", labels=["state"]
        )
        for state in ("submitted", "finished", "aborted", "failed"):
            c.add_metric([state], req.get(state, 0))
        yield c
        yield _counter("topg_engine_preemptions", "Recompute preemptions", req["preemptions"])
        t = CounterMetricFamily("topg_engine_tokens", "Tokens by kind", labels=["kind"])
        for kind in ("generated", "computed"):
            t.add_metric([kind], s["tokens"].get(kind, 0))
        yield t
        yield _counter("topg_engine_steps", "Engine steps run", steps["count"])
        yield _batch_histogram(steps["batch_sizes"])
        yield _gauge("topg_kv_blocks_used", "KV blocks in use", kv["blocks_used"])
        yield _gauge("topg_kv_blocks_total", "KV blocks in the pool", kv["blocks_total"])
        total = kv["blocks_total"] or 1
        yield _gauge(
            "topg_kv_cache_usage_ratio", "Fraction of KV blocks in use", kv["blocks_used"] / total
        )
        yield _gauge("topg_kv_cache_bytes", "Bytes of the KV pool", kv["bytes"])
        p = CounterMetricFamily(
            "topg_engine_step_time_seconds", "Engine loop time by phase", labels=["phase"]
        )
        for key, value in s["time"].items():
            if key.endswith("_s") and key != "warmup_s":
                p.add_metric([key[:-2]], value)
        yield p
        yield _gauge(
            "topg_engine_compilations_while_serving",
            "Step compilations after warm-up (should stay 0)",
            s["compile"]["while_serving"],
        )


def _stats(engine: Engine) -> dict[str, Any]:
    # The loop thread may grow a Counter while stats() copies it: retry that rare race.
    for attempt in range(5):
        try:
            return engine.stats()
        except RuntimeError:
            if attempt == 4:
                raise
            time.sleep(0.001)
    raise AssertionError("unreachable")


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _batch_histogram(sizes: dict[int, int]) -> HistogramMetricFamily:
    """Steps by number of scheduled sequences, from the engine's exact counts."""
    buckets = []
    for b in _BATCH:
        buckets.append((str(float(b)), sum(v for k, v in sizes.items() if k <= b)))
    buckets.append(("+Inf", sum(sizes.values())))
    return HistogramMetricFamily(
        "topg_batch_size",
        "Sequences per engine step",
        buckets=buckets,
        sum_value=sum(k * v for k, v in sizes.items()),
    )
