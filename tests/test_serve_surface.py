"""The server's surface beyond generation: /tokenize and /detokenize (vLLM's), several API
keys, CORS, logit_bias, min_tokens and priority through the API, a client leaving
mid-grammar, and bodies that must get a 4xx."""

from __future__ import annotations

import re

import pytest

try:
    from fastapi.testclient import TestClient
except (ImportError, RuntimeError) as e:  # starlette's TestClient needs httpx
    pytest.skip(f"fastapi's TestClient is unavailable: {e}", allow_module_level=True)

from engine_utils import wait_idle
from test_serve import GREEDY, MODEL, chat_engine

from torch_topg.serve import create_app
from torch_topg.serve.cli import api_keys, parser


@pytest.fixture(scope="module")
def engine():
    with chat_engine() as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, MODEL)) as c:
        yield c


def test_tokenize_detokenize_round_trip(client, engine) -> None:
    r = client.post("/tokenize", json={"prompt": "Hello", "model": MODEL})
    assert r.status_code == 200, r.text
    body = r.json()
    want = engine.tokenizer.encode("Hello", add_special_tokens=True)
    assert body["tokens"] == want and body["count"] == len(want)
    assert body["max_model_len"] == engine.config.max_model_len
    r = client.post("/detokenize", json={"tokens": body["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == engine.tokenizer.decode(want)
    msgs = [{"role": "user", "content": "hi"}]
    chat = client.post("/tokenize", json={"messages": msgs}).json()
    text = engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == engine.tokenizer.encode(text, add_special_tokens=False)
    bare = client.post("/tokenize", json={"messages": msgs, "add_generation_prompt": False})
    assert bare.json()["count"] < chat["count"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "a", "messages": []}, "prompt"),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
        ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1], "extra": 1}, "extra"),
    ],
)
def test_tokenize_bad_input_names_the_field(client, path, body, param) -> None:
    r = client.post(path, json=body)
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_deeply_nested_body_is_a_400(client) -> None:
    deep = b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    r = client.post("/v1/completions", content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "nests too deeply" in r.json()["error"]["message"]


def test_logit_bias_and_min_tokens_reach_the_engine(client, engine) -> None:
    req = {"prompt": "Hello", "max_tokens": 4, **GREEDY}
    (h,) = engine.tokenizer.encode("h", add_special_tokens=False)
    forced = client.post("/v1/completions", json={**req, "logit_bias": {str(h): 100}}).json()
    assert forced["choices"][0]["text"] == "hhhh"
    first = engine.generate("Hello", max_new_tokens=1, temperature=0)[0].token_ids[0]
    stop = {**req, "ignore_eos": False, "stop_token_ids": [first]}
    assert client.post("/v1/completions", json=stop).json()["usage"]["completion_tokens"] == 1
    late = client.post("/v1/completions", json={**stop, "min_tokens": 3}).json()
    assert late["usage"]["completion_tokens"] >= 3
    wait_idle(engine)


def test_several_api_keys_and_a_key_file(tmp_path) -> None:
    f = tmp_path / "keys"
    f.write_text("# team keys\nkey-b\n\nkey-c\n")
    args = parser().parse_args(["--api-key", "key-a", "--api-key-file", str(f)])
    keys = api_keys(args)
    assert keys == ["key-a", "key-b", "key-c"]
    with TestClient(create_app(None, MODEL, api_key=keys)) as c:
        for k in keys:
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {k}"}).status_code == 200
        assert c.get("/v1/models", headers={"Authorization": "Bearer key-d"}).status_code == 401
        assert c.get("/v1/models").status_code == 401


def test_cors_allowed_origins() -> None:
    app = create_app(None, MODEL, api_key="k", allowed_origins=["https://app.example"])
    with TestClient(app) as c:
        pre = c.options(
            "/v1/chat/completions",
            headers={"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization,content-type"},
        )  # fmt: skip
        assert pre.status_code == 200  # the preflight needs no key
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        other = c.get("/health", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
    with TestClient(create_app(None, MODEL)) as c:  # none given: no CORS headers at all
        r = c.get("/health", headers={"Origin": "https://app.example"})
        assert "access-control-allow-origin" not in r.headers


def test_metrics_under_vllm_names(client) -> None:
    """The main figures also as vLLM's ``vllm:*`` families with ``model_name``, equal to
    topg's own."""
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, **GREEDY})
    text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    pairs = [
        ("topg_generation_tokens_total", 'vllm:generation_tokens_total{model_name="tiny-llama"}'),
        ("topg_prompt_tokens_total", 'vllm:prompt_tokens_total{model_name="tiny-llama"}'),
        ("topg_num_requests_running", 'vllm:num_requests_running{model_name="tiny-llama"}'),
        ("topg_kv_cache_usage_ratio", 'vllm:kv_cache_usage_perc{model_name="tiny-llama"}'),
        ("topg_time_to_first_token_seconds_count",
         'vllm:time_to_first_token_seconds_count{model_name="tiny-llama"}'),
        ('topg_request_finished_total{finish_reason="length"}',
         'vllm:request_success_total{finished_reason="length",model_name="tiny-llama"}'),
    ]  # fmt: skip
    for ours, theirs in pairs:
        assert values[theirs] == values[ours], (ours, theirs)
    assert values['vllm:generation_tokens_total{model_name="tiny-llama"}'] >= 3


def test_priority_field(client, engine, monkeypatch) -> None:
    """vLLM's ``priority``: handed to ``Engine.submit``; on an engine serving in arrival
    order a non-zero one is a 400 naming it (vLLM's answer), as is a non-int."""
    req = {"prompt": "hi", "max_tokens": 2, **GREEDY}
    r = client.post("/v1/completions", json={**req, "priority": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert "scheduling_policy='priority'" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": "high"})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    seen = []
    submit = engine.submit
    monkeypatch.setattr(engine, "submit", lambda x, **kw: seen.append(kw) or submit(x, **kw))
    assert client.post("/v1/completions", json={**req, "priority": 0}).status_code == 200
    assert seen[-1]["priority"] == 0
    wait_idle(engine)


def test_disconnect_mid_grammar_frees_its_slot(client, engine) -> None:
    """A streamed request under a grammar (a regex far longer than the time the client
    stays) whose client leaves after the first event: aborted, its blocks and its grammar
    matcher released, and the next constrained request answers as before."""
    aborted = engine.stats()["requests"]["aborted"]
    req = {"prompt": "long", "max_tokens": 1800, "stream": True, "temperature": 0,
           "structured_outputs": {"regex": "[a-z]{1790}"}}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=req) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # the client goes away mid-grammar
    wait_idle(engine)
    assert engine.stats()["requests"]["aborted"] == aborted + 1
    engine.pool.check_whole()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 20, "temperature": 0,
                                              "grammar": 'root ::= "x" [0-9] "y"'})  # fmt: skip
    assert ok.status_code == 200 and re.fullmatch("x[0-9]y", ok.json()["choices"][0]["text"])
