"""A soak of the server on a real loopback port: 200 requests, 16 in flight, a seeded mix
of streamed and non-streamed completions and chats, clients that go away mid-request
(streams closed after a few events, non-streamed requests cancelled by a timeout) and
bad requests. Afterwards: every request got its answer (none hangs), the engine is idle
with its KV pool whole, /metrics counts add up with what the clients saw and with the
engine's own counts, and the process's RSS is within 5% of its value after a warm-up."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import random
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("httpx2", reason="httpx2 (the serve extra) is not installed")

import httpx2 as httpx
from engine_utils import wait_idle
from test_serve import chat_engine
from test_serve_tools import serving

from torch_topg.client.monitor import parse_metrics, value
from torch_topg.serve import create_app

MODEL = "tiny-llama"
REQUESTS, WARMUP, CONCURRENCY = 200, 32, 16
HANG_S = 120.0  # a request not answered by then counts as hung (no speed is asserted)
KINDS = {"stream": 34, "full": 30, "cancel_stream": 14, "cancel_full": 10, "bad": 12}
BAD = [  # (endpoint, body, why)
    ("/v1/completions", b"{not json", "malformed JSON"),
    ("/v1/completions", {"prompt": "hi", "frobnicate": 1}, "unknown field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, "tool"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "invalid value"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, "unknown model"),
    ("/v1/completions", {"prompt": "x" * 5000}, "prompt longer than the context"),
]


@dataclass
class Outcome:
    kind: str
    status: int | None = None  # HTTP status (None: the client left before it came)
    tokens: int = 0  # completion tokens of an answered request
    error: str = ""


def plan(n: int, seed: int) -> list[tuple[str, str, object, int]]:
    """``(kind, endpoint, body, max_tokens or events to read)`` per request, seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
        if kind == "bad":
            endpoint, body, _why = rng.choice(BAD)
            out.append((kind, endpoint, body, 0))
            continue
        cancel = kind.startswith("cancel")
        # a cancelled request asks for many tokens, so it is still running when its client goes
        max_tokens = rng.randint(200, 400) if cancel else rng.randint(1, 24)
        body: dict = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                      "stream": kind.endswith("stream")}  # fmt: skip
        words = " ".join(rng.choice(["soak", "test", "of", "the", "server"]) for _ in range(6))
        if rng.random() < 0.5:
            endpoint, body["prompt"] = "/v1/completions", words
        else:
            endpoint = "/v1/chat/completions"
            body["messages"] = [{"role": "user", "content": words}]
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        out.append((kind, endpoint, body, rng.randint(1, 4) if cancel else max_tokens))
    return out


async def one(client, url: str, kind: str, endpoint: str, body, arg: int, rng) -> Outcome:
    o = Outcome(kind)
    content = {"content": body} if isinstance(body, bytes) else {"json": body}
    headers = {"content-type": "application/json"}
    if kind in ("full", "bad"):
        r = await client.post(url + endpoint, headers=headers, **content)
        o.status = r.status_code
        if r.status_code == 200:
            o.tokens = r.json()["usage"]["completion_tokens"]
        else:
            o.error = r.json()["error"]["message"]
        return o
    if kind == "cancel_full":  # the client gives up while the answer is generated
        try:
            r = await asyncio.wait_for(
                client.post(url + endpoint, headers=headers, **content), rng.uniform(0.05, 0.4)
            )
            o.status = r.status_code  # it finished first
        except TimeoutError:
            pass
        return o
    events = 0
    async with client.stream("POST", url + endpoint, headers=headers, **content) as r:
        o.status = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                o.tokens = chunk["usage"]["completion_tokens"]
            events += 1
            if kind == "cancel_stream" and events >= arg:
                return o  # leaving the block closes the connection mid-stream
        else:
            pytest.fail("a stream ended without data: [DONE]")
    return o


async def soak(url: str, n: int, seed: int) -> list[Outcome]:
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(timeout=httpx.Timeout(HANG_S), limits=limits) as client:

        async def bounded(item) -> Outcome:
            async with sem:
                return await asyncio.wait_for(one(client, url, *item, rng), HANG_S)

        return await asyncio.gather(*(bounded(item) for item in plan(n, seed)))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:  # Linux: size, resident, ... in pages
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def scrape(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics") as r:
        return parse_metrics(r.read().decode())


@pytest.fixture(scope="module")
def soak_server():
    with chat_engine() as eng, serving(create_app(eng, MODEL)) as url:
        yield url, eng


def test_soak(soak_server, caplog) -> None:
    url, engine = soak_server
    caplog.set_level(logging.ERROR)
    asyncio.run(soak(url, WARMUP, seed=1))  # warm-up: the same mix, fewer requests
    wait_idle(engine)
    gc.collect()
    rss_warm = rss_bytes()
    s0, m0 = engine.stats()["requests"], scrape(url)

    outcomes = asyncio.run(soak(url, REQUESTS, seed=0))

    wait_idle(engine)
    engine.pool.check_whole()
    s1, m1 = engine.stats(), scrape(url)
    req = s1["requests"]
    assert req["running"] == 0 and req["waiting"] == 0 and s1["kv"]["blocks_used"] == 0
    by_kind: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, []).append(o)
    assert set(by_kind) == set(KINDS), "the mix has every kind"

    # what the clients saw
    assert all(o.status == 400 for o in by_kind["bad"]), [o.error for o in by_kind["bad"]]
    answered = by_kind["stream"] + by_kind["full"]
    assert all(o.status == 200 for o in answered)
    assert all(o.status == 200 for o in by_kind["cancel_stream"])
    assert all(o.status in (None, 200) for o in by_kind["cancel_full"])
    for (kind, _, body, _), o in zip(plan(REQUESTS, 0), outcomes, strict=True):
        if kind == "full" or (kind == "stream" and "stream_options" in body):
            assert o.tokens == body["max_tokens"]  # ignore_eos, greedy: exact

    # the engine's counts: every request it took ended, none failed, some were aborted
    d = {k: req[k] - s0[k] for k in ("submitted", "finished", "aborted", "failed")}
    cancels = len(by_kind["cancel_stream"]) + len(by_kind["cancel_full"])
    assert d["failed"] == 0
    assert d["submitted"] == d["finished"] + d["aborted"]
    assert d["submitted"] == len(answered) + cancels  # n=1, one prompt each; bad ones never
    assert d["aborted"] >= 1

    # /metrics against the clients and the engine
    def delta(name: str, **labels: str) -> float:
        return (value(m1, name, **labels) or 0.0) - (value(m0, name, **labels) or 0.0)

    http = "topg_http_requests_total"
    v1 = ("/v1/completions", "/v1/chat/completions")
    bad = sum(delta(http, endpoint=e, status="400") for e in v1)
    ok = sum(delta(http, endpoint=e, status="200") for e in v1)
    gone = sum(delta(http, endpoint=e, status="499") for e in v1)
    assert bad == len(by_kind["bad"])
    assert ok + gone == d["submitted"]  # a non-streamed request whose client left: 499
    assert sum(delta(http, endpoint=e) for e in v1) == REQUESTS
    fin = "topg_request_finished_total"
    assert delta(fin) == d["submitted"]  # each sample counted once, by its finish reason
    assert delta(fin, finish_reason="abort") >= 1
    assert delta(fin, finish_reason="length") >= len(answered)
    assert delta("topg_generation_tokens_total") >= sum(o.tokens for o in answered)
    assert value(m1, "topg_num_requests_running") == 0
    assert value(m1, "topg_kv_blocks_used") == 0

    gc.collect()
    # nothing went wrong out of sight (an exception never retrieved, an error in a task)
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    rss = rss_bytes()
    assert rss <= 1.05 * rss_warm, f"RSS {rss / 2**20:.0f} MiB after, {rss_warm / 2**20:.0f} warm"
