"""Prometheus metrics of the server (``GET /metrics``, prometheus-client's text format).

Two sources: the per-request outputs (finish reasons, token counts, TTFT, inter-token
and end-to-end latency), observed by the server when a request ends; and
``engine.stats()`` (running / waiting requests, KV blocks, steps, batch sizes), read at
every scrape by a collector, so those are the engine's own numbers at that moment.
Each app has its own registry: several apps (tests) in one process do not collide. The
main figures are exported under vLLM's names too (``metrics_vllm.py``).
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
from torch_topg.serve.metrics_vllm import VllmAliases

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
FINISH_REASONS = ("stop", "length", "abort")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_REQUEST = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """The registry and the per-request instruments; ``engine`` is read at scrape time
    (None while the model loads: the engine metrics are then absent)."""

    def __init__(
        self, engine: Callable[[], Engine | None], model_name: Callable[[], str] = lambda: ""
    ) -> None:
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
        # engine.stats() is read once a scrape: its families and their vLLM names together
        r.register(VllmAliases([_EngineCollector(engine)], model_name, include_sources=True))
        instruments = (self.finished, self.prompt_tokens, self.generation_tokens, self.ttft,
                       self.itl, self.tpot, self.e2e)  # fmt: skip
        r.register(VllmAliases(instruments, model_name))

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

    def __init__(
        self, engine: Callable[[], Engine | None], model_name: Callable[[], str] = lambda: ""
    ) -> None:
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
        yield from _kv_tier_metrics(kv)
        yield from _speculative_metrics(s.get("speculative"))


# engine.stats()["kv"]["tiers"][tier]: these keys are levels (gauges); every other number
# is a count of events since start (counters), bytes_read / bytes_written in bytes.
_TIER_GAUGES = ("blocks_total", "blocks_used", "blocks_cached", "bytes")
_TIER_BYTES = ("bytes_read", "bytes_written")
MAX_SESSIONS = 100  # sessions exported per scrape (label cardinality): the busiest ones


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _kv_tier_metrics(kv: dict[str, Any]) -> Iterator[Metric]:
    """Prefix-cache, KV-tier and session figures of ``stats()["kv"]``: each exported when
    the engine reports it, absent otherwise (an engine without those features)."""
    if "prefix_caching" in kv:
        yield _gauge("topg_prefix_cache_enabled", "1 if prefix caching is on",
                     float(bool(kv["prefix_caching"])))  # fmt: skip
    for key, doc in (
        ("queries", "Prefix-cache lookups (one per admitted sequence)"),
        ("query_tokens", "Prompt tokens looked up in the prefix cache"),
        ("hit_tokens", "Prompt tokens found in the KV cache (any tier) and not recomputed"),
    ):
        if _num(kv.get(key)):
            yield _counter(f"topg_prefix_cache_{key}", doc, kv[key])
    if _num(kv.get("hit_rate")):
        yield _gauge("topg_prefix_cache_hit_rate", "hit_tokens / query_tokens since start",
                     kv["hit_rate"])  # fmt: skip
    tiers = kv.get("tiers")
    if isinstance(tiers, dict) and tiers:
        gauges = {k: GaugeMetricFamily(f"topg_kv_tier_{k}", f"KV {k} per tier", labels=["tier"])
                  for k in _TIER_GAUGES}  # fmt: skip
        events = CounterMetricFamily(
            "topg_kv_tier_events",
            "KV block events per tier (hits, promoted, stored, evicted, dropped, errors, ...)",
            labels=["tier", "event"],
        )
        io = CounterMetricFamily("topg_kv_tier_io_bytes", "Bytes moved per tier",
                                 labels=["tier", "direction"])  # fmt: skip
        for tier, c in tiers.items():
            if not isinstance(c, dict):
                continue
            for key, v in sorted(c.items()):
                if not _num(v):
                    continue
                if key in _TIER_GAUGES:
                    gauges[key].add_metric([tier], v)
                elif key in _TIER_BYTES:
                    io.add_metric([tier, key.removeprefix("bytes_")], v)
                else:
                    events.add_metric([tier, key], v)
        for fam in (*gauges.values(), events, io):
            if fam.samples:
                yield fam
    if _num(kv.get("active_sessions")):
        yield _gauge("topg_sessions_active", "Sessions with a recent request (session_ttl)",
                     kv["active_sessions"])  # fmt: skip
    sessions = kv.get("sessions")
    if isinstance(sessions, dict) and sessions:
        busiest = sorted(sessions.items(), key=lambda kv_: -_count(kv_[1], "requests"))
        fams = {k: CounterMetricFamily(f"topg_session_{k}", doc, labels=["session"])
                for k, doc in (("requests", "Requests per session"),
                               ("query_tokens", "Prompt tokens per session"),
                               ("hit_tokens", "Prompt tokens read from the cache per session"))}  # fmt: skip
        for sid, c in busiest[:MAX_SESSIONS]:
            for k, fam in fams.items():
                if isinstance(c, dict) and _num(c.get(k)):
                    fam.add_metric([str(sid)], c[k])
        yield from (f for f in fams.values() if f.samples)


def _count(c: Any, key: str) -> float:
    return c.get(key, 0) if isinstance(c, dict) and _num(c.get(key)) else 0


def _speculative_metrics(spec: Any) -> Iterator[Metric]:
    """``stats()["speculative"]`` (present when the engine speculates)."""
    if not isinstance(spec, dict):
        return
    for key, doc in (
        ("proposals", "Speculative proposals verified"),
        ("proposed_tokens", "Draft tokens proposed"),
        ("accepted_tokens", "Draft tokens accepted"),
        ("skipped_steps", "Steps that did not speculate (adaptive k = 0)"),
    ):
        if _num(spec.get(key)):
            yield _counter(f"topg_spec_{key}", doc, spec[key])
    for key, doc in (
        ("acceptance_rate", "accepted_tokens / proposed_tokens since start"),
        ("mean_accepted_length", "Tokens committed per verified proposal (accepted + 1)"),
        ("acceptance_estimate", "The adaptive controller's running acceptance estimate"),
    ):
        if _num(spec.get(key)):
            yield _gauge(f"topg_spec_{key}", doc, spec[key])
    per_pos = spec.get("acceptance_per_position")
    if isinstance(per_pos, list) and per_pos:
        g = GaugeMetricFamily("topg_spec_acceptance_by_position",
                              "Acceptance rate of the draft token at each position",
                              labels=["position"])  # fmt: skip
        for i, v in enumerate(per_pos):
            if _num(v):
                g.add_metric([str(i)], v)
        yield g


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
