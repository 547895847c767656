"""``python -m torch_topg bench serve``: a load generator for any OpenAI-compatible server.

Per concurrency level it sends ``--requests`` streamed chat completions, at most
``concurrency`` in flight, and measures per request, on the client's clock:

- TTFT: sending the request to the first chunk with content;
- ITL: every gap between two consecutive content chunks;
- TPOT: ``(e2e - TTFT) / (output_tokens - 1)`` (vLLM's definition);
- e2e: sending the request to the end of the stream.

Output tokens come from the stream's ``usage`` (``stream_options.include_usage``) when
the server sends it, else one per content chunk, so it works against llama.cpp's
``llama-server`` or vLLM as well as ours; nothing topg-specific is read. A level reports
request throughput and output tokens/s over its wall time, and mean / p50 / p90 / p99 of
each latency, as a Markdown table and a ``torch_topg.bench/1`` record (``--json``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from torch_topg.bench.timing import Stats, quantile
from torch_topg.client.datasets import DATASETS, Messages, make_requests

try:  # the same API under either name; starlette's TestClient accepts both too
    import httpx
except ImportError:  # pragma: no cover - depends on the environment
    try:
        import httpx2 as httpx  # type: ignore[no-redef]
    except ImportError:
        httpx = None  # type: ignore[assignment]

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it; times in seconds on ``time.perf_counter``."""

    ok: bool
    error: str = ""
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def chunk_times_to_result(
    start: float, times: list[float], end: float, tokens: int | None
) -> RequestResult:
    """A successful request from its send time, content-chunk arrival times and end time;
    ``tokens`` from ``usage`` (None: one per content chunk)."""
    n = len(times) if tokens is None else tokens
    return RequestResult(
        ok=True,
        output_tokens=n,
        ttft=times[0] - start if times else None,
        e2e=end - start,
        itl=[b - a for a, b in itertools.pairwise(times)],
    )


def latency_summary(xs: list[float]) -> dict[str, float] | None:
    """``{"mean", "p10", "p50", "p90", "p99", "n"}`` of ``xs`` in milliseconds (None if empty);
    percentiles interpolate linearly between order statistics (numpy's default)."""
    if not xs:
        return None
    out = {"mean": statistics.fmean(xs) * 1e3}
    for p in (10, *PERCENTILES):
        out[f"p{p}"] = quantile(xs, p / 100) * 1e3
    out["n"] = len(xs)
    return out


def summarize_level(
    results: list[RequestResult], concurrency: int, duration: float
) -> dict[str, Any]:
    """One concurrency level: counts, throughputs over ``duration`` and latency summaries."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    series = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(prompt) if prompt else None,
        "cached_tokens": sum(cached) if cached else None,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_tokens_per_s": out_tokens / duration if duration > 0 else 0.0,
        "latency_ms": {k: latency_summary(v) for k, v in series.items()},
    }


async def one_request(
    client: Any, url: str, model: str, messages: Messages, max_tokens: int, extra: dict[str, Any]
) -> RequestResult:
    """Stream one chat completion; never raises (a failure is a result with ``ok=False``)."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    times: list[float] = []
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                return RequestResult(ok=False, error=f"HTTP {r.status_code}: {text[:200]}")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event names
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(ok=False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        times.append(time.perf_counter())
    except Exception as e:  # a refused connection, a timeout, a bad chunk: count it failed
        return RequestResult(ok=False, error=f"{type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    tokens = usage.get("completion_tokens") if usage else None
    res = chunk_times_to_result(start, times, end, tokens)
    if usage:
        res.prompt_tokens = usage.get("prompt_tokens")
        res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return res


async def run_level(
    url: str,
    model: str,
    requests: list[Messages],
    concurrency: int,
    max_tokens: int,
    extra: dict[str, Any] | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Send every request of ``requests`` with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:

        async def bounded(messages: Messages) -> RequestResult:
            async with sem:
                return await one_request(client, url, model, messages, max_tokens, extra or {})

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(m) for m in requests))
        duration = time.perf_counter() - t0
    return summarize_level(list(results), concurrency, duration)


def served_model(url: str, timeout: float = 30.0) -> str:
    """The first model ``GET /v1/models`` lists."""
    r = httpx.get(f"{url}/v1/models", timeout=timeout)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def markdown_table(levels: list[dict[str, Any]]) -> str:
    """One row per concurrency level; latencies in ms as ``mean / p50 / p90 / p99``."""
    head = ["conc", "ok/sent", "req/s", "out tok/s"] + [
        f"{k.upper()} ms mean/p50/p90/p99" for k in LATENCIES
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for lv in levels:
        cells = [str(lv["concurrency"]), f"{lv['completed']}/{lv['requests']}",
                 f"{lv['request_throughput']:.2f}", f"{lv['output_tokens_per_s']:.1f}"]  # fmt: skip
        for k in LATENCIES:
            s = lv["latency_ms"][k]
            cells.append(
                "-"
                if s is None
                else " / ".join(f"{s[q]:.1f}" for q in ("mean", "p50", "p90", "p99"))
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def level_row(level: dict[str, Any], key: str) -> dict[str, Any]:
    """A ``torch_topg.bench/1`` row of one level: its summary plus ``figures`` as
    ``Stats`` in ms (p50 as the median, p10-p90 as the spread) and the throughputs as
    single values (higher is better)."""
    figures: dict[str, Any] = {}
    for k in LATENCIES:
        s = level["latency_ms"][k]
        if s is not None:
            figures[k] = Stats(s["p50"], s["p10"], s["p90"], int(s["n"]), "p10-p90").to_dict()
    for k in ("request_throughput", "output_tokens_per_s"):
        figures[k] = Stats(level[k], level[k], level[k], 1, "min-max").to_dict()
    return {"key": key, "unit": "ms", "figures": figures,
            "higher_is_better": ["request_throughput", "output_tokens_per_s"], **level}  # fmt: skip


def to_record(
    levels: list[dict[str, Any]], meta: dict[str, Any], argv: list[str]
) -> dict[str, Any]:
    """A ``torch_topg.bench/1`` record: a row per level (:func:`level_row`), keyed
    ``dataset | c=N | max_tokens=M``; ``meta`` becomes the notes."""
    from torch_topg.bench.machine import machine_info
    from torch_topg.bench.record import new_record, validate

    rows = [
        level_row(
            lv, f"{meta['dataset']} | c={lv['concurrency']} | max_tokens={meta['max_tokens']}"
        )
        for lv in levels
    ]
    notes = [f"{k}={v}" for k, v in meta.items()]
    return validate(new_record("serve", rows, machine_info(measure=False), notes=notes, argv=argv))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m torch_topg bench serve",
        description="Load-test an OpenAI-compatible server with streamed chat completions.",
    )
    p.add_argument("--url", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument(
        "--concurrency", default="1,4,16", help="comma-separated levels (default 1,4,16)"
    )
    p.add_argument("--requests", type=int, default=64, help="requests per level")
    p.add_argument("--dataset", default="chat", choices=DATASETS)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--model", default=None, help="the model field (default: the first of /v1/models)"
    )
    p.add_argument("--input-len", type=int, default=128, help="words per random prompt")
    p.add_argument("--prefix-len", type=int, default=512, help="words of the shared system prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the random datasets")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM / llama-server / topg extension) for fixed lengths")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json", default=None, help="write the record (torch_topg.bench/1) here")
    return p


def serve_bench_main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if httpx is None:
        print("bench serve needs httpx (pip install httpx)", flush=True)
        return 2
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        if not levels or min(levels) < 1 or args.requests < 1 or args.max_tokens < 1:
            raise ValueError
    except ValueError:
        print("--concurrency: positive integers like 1,4,16; --requests, --max-tokens >= 1")
        return 2
    url = args.url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    try:
        model = args.model or served_model(url)
    except Exception as e:
        print(f"cannot list the models at {url}/v1/models ({e}); give --model")
        return 1
    reqs = make_requests(args.dataset, args.requests, seed=args.seed,
                         input_len=args.input_len, prefix_len=args.prefix_len)  # fmt: skip
    extra: dict[str, Any] = {"temperature": args.temperature}
    if args.ignore_eos:
        extra["ignore_eos"] = True
    print(f"{url}  model={model}  dataset={args.dataset}  requests={args.requests}  "
          f"max_tokens={args.max_tokens}", flush=True)  # fmt: skip
    results = []
    for c in levels:
        lv = asyncio.run(run_level(url, model, reqs, c, args.max_tokens, extra, args.timeout))
        results.append(lv)
        print(f"concurrency {c}: {lv['completed']}/{lv['requests']} ok in {lv['duration_s']:.2f} s"
              + (f"; errors: {lv['errors']}" if lv["errors"] else ""), flush=True)  # fmt: skip
    print()
    print(markdown_table(results), end="")
    if args.json:
        meta = {"url": url, "model": model, "dataset": args.dataset, "requests": args.requests,
                "max_tokens": args.max_tokens, "temperature": args.temperature,
                "ignore_eos": args.ignore_eos, "seed": args.seed}  # fmt: skip
        rec = to_record(results, meta, ["python", "-m", "torch_topg", "bench", "serve", *argv])
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rec, indent=1) + "\n")
        print(f"\nrecord: {args.json}")
    return 0 if all(lv["failed"] == 0 for lv in results) else 1
