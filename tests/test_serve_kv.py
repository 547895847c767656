"""The server and the engine's KV features: ``usage.prompt_tokens_details.cached_tokens``
from the prefix cache, the ``session_id`` extension, and the /metrics families and
monitor lines of the KV tiers, prefix cache, sessions and speculative decoding (each
exported when ``engine.stats()`` has it, absent when it does not)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
try:
    from fastapi.testclient import TestClient
except (ImportError, RuntimeError) as e:  # starlette's TestClient needs httpx2 (or httpx)
    pytest.skip(f"fastapi's TestClient is unavailable: {e}", allow_module_level=True)

from engine_utils import wait_idle
from test_serve import chat_engine, events

from torch_topg.client import monitor
from torch_topg.serve import create_app
from torch_topg.serve.metrics import ServerMetrics

MODEL = "tiny-llama"
GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPT = "a prompt long enough to fill a few KV blocks of four tokens"


@pytest.fixture(scope="module")
def engine():
    with chat_engine() as eng:
        if "hit_tokens" not in eng.stats()["kv"]:
            pytest.skip("this engine has no prefix cache (engine.stats()['kv'] lacks hit_tokens)")
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, MODEL)) as c:
        yield c


@pytest.fixture(autouse=True)
def whole_pool_after(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        wait_idle(eng)
        eng.pool.check_whole()


def metrics(client) -> dict[str, list]:
    return monitor.parse_metrics(client.get("/metrics").text)


def test_cached_tokens_in_usage(client, engine) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, **GREEDY}
    client.post("/v1/completions", json=body)  # the prompt's full blocks are now cached
    want = engine.generate(PROMPT, max_new_tokens=3, **GREEDY)[0].cached_prompt_tokens
    assert want > 0
    u = client.post("/v1/completions", json=body).json()["usage"]
    assert u["prompt_tokens_details"] == {"cached_tokens": want}
    with client.stream("POST", "/v1/completions", json={
        **body, "stream": True, "stream_options": {"include_usage": True}
    }) as r:  # fmt: skip
        last = events(r)[-2]
    assert last["usage"]["prompt_tokens_details"] == {"cached_tokens": want}


def test_session_id_reaches_the_engine(client, engine) -> None:
    msgs = [{"role": "user", "content": "Hi, remember me?"}]
    r = client.post(
        "/v1/chat/completions",
        json={"messages": msgs, "max_tokens": 2, "session_id": "conv-42", **GREEDY},
    )
    assert r.status_code == 200, r.text
    assert engine.stats()["kv"]["sessions"]["conv-42"]["requests"] == 1
    for bad in (7, "", "x" * 300):
        r = client.post(
            "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "session_id": bad}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"


def test_metrics_export_prefix_cache_tiers_sessions(client, engine) -> None:
    before = metrics(client)
    body = {"prompt": PROMPT + " again", "max_tokens": 2, "session_id": "m1", **GREEDY}
    client.post("/v1/completions", json=body)
    out = client.post("/v1/completions", json=body).json()
    wait_idle(engine)
    after = metrics(client)
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0
    hit = "topg_prefix_cache_hit_tokens_total"
    assert monitor.value(after, hit) - monitor.value(before, hit) >= cached
    assert monitor.value(after, "topg_prefix_cache_enabled") == 1
    assert 0 < monitor.value(after, "topg_prefix_cache_hit_rate") <= 1
    kv = engine.stats()["kv"]
    dev = kv["tiers"]["device"]
    assert monitor.value(after, "topg_kv_tier_blocks_total", tier="device") == dev["blocks_total"]
    assert monitor.value(after, "topg_kv_tier_events_total", tier="device", event="hits") >= 1
    assert monitor.value(after, "topg_session_requests_total", session="m1") == 2
    assert monitor.value(after, "topg_session_hit_tokens_total", session="m1") >= cached
    assert monitor.value(after, "topg_sessions_active") == kv["active_sessions"]


# --- present -> exported, absent -> not: synthetic engine statistics -----------------------
HOST = {"blocks_total": 64, "blocks_used": 5, "bytes": 4096, "hits": 3, "promoted": 3,
        "stored": 9, "evicted": 4, "dropped": 1, "errors": 0, "bytes_read": 300,
        "bytes_written": 900}  # fmt: skip
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "proposals": 10, "proposed_tokens": 40,
        "accepted_tokens": 25, "skipped_steps": 2, "acceptance_rate": 0.625,
        "acceptance_per_position": [0.9, 0.7, 0.5, 0.4], "mean_accepted_length": 3.5,
        "acceptance_estimate": 0.6, "cost_curve_s": {1: 0.01}, "time": {}}  # fmt: skip


def render(stats: dict) -> dict[str, list]:
    fake = SimpleNamespace(stats=lambda: stats)
    return monitor.parse_metrics(ServerMetrics(lambda: fake).render().decode())


def test_feature_metrics_present_and_absent(engine) -> None:
    full = copy.deepcopy(engine.stats())
    full["kv"]["tiers"]["host"] = HOST
    full["kv"]["tiers"]["disk"] = {"blocks_total": 0, "blocks_used": 0, "future_count": 2}
    full["speculative"] = SPEC
    s = render(full)
    assert monitor.value(s, "topg_kv_tier_blocks_used", tier="host") == 5
    assert monitor.value(s, "topg_kv_tier_bytes", tier="host") == 4096
    for event in ("hits", "promoted", "stored", "evicted", "dropped"):
        assert (
            monitor.value(s, "topg_kv_tier_events_total", tier="host", event=event) == HOST[event]
        )
    assert monitor.value(s, "topg_kv_tier_events_total", tier="disk", event="future_count") == 2
    assert monitor.value(s, "topg_kv_tier_io_bytes_total", tier="host", direction="read") == 300
    assert monitor.value(s, "topg_kv_tier_io_bytes_total", tier="host", direction="written") == 900
    assert monitor.value(s, "topg_spec_accepted_tokens_total") == 25
    assert monitor.value(s, "topg_spec_acceptance_rate") == 0.625
    assert monitor.value(s, "topg_spec_acceptance_by_position", position="1") == 0.7
    frame = monitor.frame("u", s, None, 0.0)
    assert "KV tiers   " in frame and "host 5/64 (hits 3, evicted 4)" in frame
    assert "speculative acceptance 62.5%, 3.50 tokens per verify" in frame
    assert "prefix     hit rate" in frame and "sessions   " in frame

    bare = copy.deepcopy(engine.stats())  # an engine from before those features
    for key in ("prefix_caching", "queries", "query_tokens", "hit_tokens", "hit_rate", "tiers",
                "sessions", "active_sessions"):  # fmt: skip
        bare["kv"].pop(key, None)
    s = render(bare)
    names = " ".join(s)
    for prefix in ("topg_prefix_cache", "topg_kv_tier", "topg_session", "topg_spec"):
        assert prefix not in names
    assert monitor.value(s, "topg_kv_blocks_total") == bare["kv"]["blocks_total"]
    frame = monitor.frame("u", s, None, 0.0)
    assert not any(w in frame for w in ("KV tiers", "prefix ", "sessions ", "speculative"))
