"""The OpenAI-compatible server (torch_topg.serve) in process, through FastAPI's TestClient,
on a tiny seeded Llama with a byte-level tokenizer and a chat template: completions and
chat, streamed and not, n, stop, usage, logprobs, the 400s naming the field, health,
models, metrics, disconnects."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("prometheus_client", reason="the serve extra is not installed")
try:
    from fastapi.testclient import TestClient
except (ImportError, RuntimeError) as e:  # starlette's TestClient needs httpx2 (or httpx)
    pytest.skip(f"fastapi's TestClient is unavailable: {e}", allow_module_level=True)

from engine_utils import tiny, wait_idle

from torch_topg.engine import Engine
from torch_topg.serve import create_app

MODEL = "tiny-llama"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokenizer():
    """Byte-level BPE without merges: one token per byte (ids 0..255) plus 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2], pad_token=SPECIALS[0]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def chat_engine(**options) -> Engine:
    """A tiny seeded Llama on the byte tokenizer with its chat specials (eager);
    ``options`` go to ``Engine.from_model``."""
    tok = byte_tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    model = tiny(
        "llama-tiny", vocab_size=len(tok), bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    return Engine.from_model(
        model, tok, **{"block_size": 4, "compile": False, "seed": 0, **options}
    )


@pytest.fixture(scope="module")
def engine():
    with chat_engine() as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, MODEL)) as c:
        yield c


@pytest.fixture(autouse=True)
def whole_pool_after(engine):
    yield
    wait_idle(engine)
    engine.pool.check_whole()


def events(response) -> list:
    """The SSE events of a streamed response: JSON objects, then the string ``[DONE]``."""
    out = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


GREEDY = {"temperature": 0, "ignore_eos": True}


# --- completions ----------------------------------------------------------------------
def test_completion_greedy_equals_engine_generate(client, engine) -> None:
    want = engine.generate("Hello there", max_new_tokens=12, **GREEDY)[0]
    r = client.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello there", "max_tokens": 12, **GREEDY},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert choice["text"] == want.text
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert body["usage"] == {
        "prompt_tokens": want.prompt_tokens,
        "completion_tokens": 12,
        "total_tokens": want.prompt_tokens + 12,
        # the prompt was just run: a repeat of it reads what the prefix cache holds
        "prompt_tokens_details": {"cached_tokens": _cached_on_repeat(engine, "Hello there")},
    }


def _cached_on_repeat(engine, prompt) -> int:
    return engine.generate(prompt, max_new_tokens=1, **GREEDY)[0].cached_prompt_tokens


def test_completion_stream_chunks_and_done(client) -> None:
    req = {"prompt": "Hello there", "max_tokens": 10, **GREEDY}
    full = client.post("/v1/completions", json=req).json()
    with client.stream("POST", "/v1/completions", json={**req, "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        evs = events(r)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["object"] == "text_completion" and "usage" not in c for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_stream_include_usage(client) -> None:
    req = {"prompt": "abc", "max_tokens": 5, "stream": True, **GREEDY,
           "stream_options": {"include_usage": True}}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=req) as r:
        evs = events(r)
    assert evs[-1] == "[DONE]"
    *chunks, last = evs[:-1]
    assert all(c["usage"] is None for c in chunks)
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 5
    assert last["usage"]["prompt_tokens"] == 3
    assert last["usage"]["total_tokens"] == 8


def test_n_and_several_prompts(client) -> None:
    req = {"prompt": ["ab", "cd"], "n": 2, "max_tokens": 4, "temperature": 1.0, "seed": 3,
           "ignore_eos": True}  # fmt: skip
    r = client.post("/v1/completions", json=req)
    assert r.status_code == 200, r.text
    body = r.json()
    assert sorted(c["index"] for c in body["choices"]) == [0, 1, 2, 3]  # prompt * n + sample
    assert body["usage"]["prompt_tokens"] == 4
    assert body["usage"]["completion_tokens"] == 16
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    # seeded: the same request gives the same samples
    again = client.post("/v1/completions", json=req).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]


def test_n_streamed(client) -> None:
    req = {"prompt": "xyz", "n": 2, "max_tokens": 6, "stream": True, "temperature": 1.0,
           "seed": 1, "ignore_eos": True}  # fmt: skip
    with client.stream("POST", "/v1/completions", json=req) as r:
        evs = events(r)
    full = client.post("/v1/completions", json={**req, "stream": False}).json()
    texts = {0: "", 1: ""}
    for c in evs[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
    assert texts == {c["index"]: c["text"] for c in full["choices"]}


def test_stop_string(client, engine) -> None:
    free = engine.generate("The sky", max_new_tokens=16, **GREEDY)[0].text
    assert len(free) >= 4
    stop = free[2:4]
    cut = free[: free.find(stop)]
    r = client.post(
        "/v1/completions", json={"prompt": "The sky", "max_tokens": 16, "stop": [stop], **GREEDY}
    )
    (choice,) = r.json()["choices"]
    assert choice["text"] == cut
    assert choice["finish_reason"] == "stop"


def test_completion_logprobs(client) -> None:
    r = client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "logprobs": 2, **GREEDY}
    )
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 3
    assert all(x <= 0 for x in lp["token_logprobs"])
    assert all(len(t) <= 2 for t in lp["top_logprobs"])
    # greedy: the sampled token is the most likely one
    for top, v in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True):
        assert max(top.values()) == pytest.approx(v)


def test_token_id_prompt(client, engine) -> None:
    want = engine.generate([[5, 6, 7]], max_new_tokens=4, **GREEDY)[0]
    r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, **GREEDY})
    assert r.json()["choices"][0]["text"] == want.text


# --- chat ------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]


def test_chat_greedy_equals_engine_generate(client, engine) -> None:
    want = engine.generate([MESSAGES], max_new_tokens=8, **GREEDY)[0]
    r = client.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 8, **GREEDY},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": want.text}
    assert choice["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == want.prompt_tokens


def test_chat_text_parts_and_max_completion_tokens(client) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]
    a = client.post("/v1/chat/completions",
                    json={"messages": parts, "max_completion_tokens": 5, **GREEDY}).json()  # fmt: skip
    b = client.post("/v1/chat/completions",
                    json={"messages": MESSAGES[1:], "max_tokens": 5, **GREEDY}).json()  # fmt: skip
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"]["completion_tokens"] == 5


def test_chat_stream(client) -> None:
    req = {"messages": MESSAGES, "max_tokens": 8, **GREEDY}
    full = client.post("/v1/chat/completions", json=req).json()
    with client.stream("POST", "/v1/chat/completions", json={**req, "stream": True}) as r:
        evs = events(r)
    assert evs[-1] == "[DONE]"
    chunks = evs[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == full["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_logprobs(client) -> None:
    r = client.post(
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, **GREEDY},
    )
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == pytest.approx(entry["logprob"])
        assert len(entry["bytes"]) == 1  # one byte a token, also where the text is U+FFFD


# --- refusals: 400 naming the field -----------------------------------------------------
@pytest.mark.parametrize(
    ("path", "extra", "param", "words"),
    [
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0].function", "object"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "needs tools"),
        # structured outputs: malformed or not compiling, 400 naming the field
        ("/v1/chat/completions", {"guided_regex": "a(b"}, "guided_regex", "does not compile"),
        ("/v1/completions", {"grammar": "root ::= nothing"}, "grammar", "does not compile"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "response_format.json_schema.schema",
            "does not compile",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "required",
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "xml"}},
            "response_format.type",
            "xml",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"regex": 5}},
            "structured_outputs.regex",
            "string",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"yaml": "x"}},
            "structured_outputs.yaml",
            "not supported",
        ),
        ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty list"),
        ("/v1/completions", {"json_schema": "{oops"}, "json_schema", "schema"),
        (
            "/v1/chat/completions",
            {"guided_regex": "a+", "response_format": {"type": "json_object"}},
            "guided_regex",
            "only one",
        ),
        ("/v1/chat/completions", {"functions": []}, "functions", "not supported"),
        ("/v1/completions", {"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias", "outside"),
        ("/v1/completions", {"min_tokens": -1}, "min_tokens", ">= 0"),
        ("/v1/completions", {"suffix": "x"}, "suffix", "not supported"),
        ("/v1/completions", {"frobnicate": 1}, "frobnicate", "unknown field"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs", "logprobs=true"),
        ("/v1/completions", {"max_tokens": -1}, "max_tokens", ">= 1"),
        ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens", ">= 1"),
        ("/v1/completions", {"temperature": -0.5}, "temperature", "temperature"),
        ("/v1/completions", {"top_p": 1.5}, "top_p", "top_p"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty", "presence_penalty"),
        ("/v1/completions", {"n": 0}, "n", "n must be"),
        ("/v1/completions", {"stop": [""]}, "stop", "stop"),
        ("/v1/completions", {"logprobs": 50}, "logprobs", "logprobs"),
        (
            "/v1/completions",
            {"stream_options": {"include_usage": True}},
            "stream_options",
            "stream",
        ),
        ("/v1/completions", {"model": "gpt-4"}, "model", "not served"),
        ("/v1/completions", {"prompt": "x" * 5000}, "prompt", "max_model_len"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "required",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
            "text parts",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "assistant", "content": "", "tool_calls": []}]},
            "messages[0].tool_calls",
            "non-empty",
        ),
        ("/v1/completions", {"temperature": "hot"}, "temperature", "a number"),
        ("/v1/completions", {"top_k": -3}, "top_k", "top_k"),
        ("/v1/completions", {"seed": "s"}, "seed", "seed"),
        ("/v1/completions", {"prompt": []}, "prompt", "prompt must be"),
        ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "prompt must be"),
    ],
)
def test_bad_requests_name_the_field(client, path, extra, param, words) -> None:
    base = {"prompt": "hi"} if path == "/v1/completions" else {"messages": MESSAGES}
    if "max_completion_tokens" not in extra:
        base["max_tokens"] = 2
    r = client.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert param.split("[")[0] in err["message"] and words in err["message"], err["message"]


def test_null_fields_are_absent_and_malformed_json(client) -> None:
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "logit_bias": None})
    assert r.status_code == 200
    r = client.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json=["a list"])
    assert r.status_code == 400


# --- models, health, metrics, api key, disconnect ---------------------------------------
def test_models(client, engine) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert card["id"] == MODEL and card["object"] == "model"
    assert card["max_model_len"] == engine.config.max_model_len


def test_health_loading_then_ready(engine) -> None:
    app = create_app(None, MODEL)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 503
        r = c.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        app.state.topg.set_engine(engine)
        r = c.get("/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        # "warm": false only while the warm-up compiles in the background
        assert r.json()["warm"] == (engine.runner.background_state != "compiling")
        assert engine.runner.wait_compiled(timeout=600)
        assert c.get("/health").json()["warm"] is True


def _samples(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.name + json.dumps(s.labels, sort_keys=True): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


NAMES = [
    "topg_request_finished_total", "topg_time_to_first_token_seconds_count",
    "topg_inter_token_latency_seconds_count", "topg_time_per_output_token_seconds_count",
    "topg_e2e_request_latency_seconds_count", "topg_prompt_tokens_total",
    "topg_generation_tokens_total", "topg_num_requests_running", "topg_num_requests_waiting",
    "topg_kv_blocks_used", "topg_kv_blocks_total", "topg_batch_size_count",
    "topg_engine_steps_total", "topg_http_requests_total",
]  # fmt: skip


def test_metrics_names_and_counts_move(client) -> None:
    before = _samples(client.get("/metrics").text)
    for name in NAMES:
        if name not in ("topg_http_requests_total",):
            assert any(k.startswith(name) for k in before), name
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, **GREEDY})
    assert r.status_code == 200
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    after = _samples(r.text)
    length = 'topg_request_finished_total{"finish_reason": "length"}'
    assert after[length] == before.get(length, 0) + 1
    assert after["topg_generation_tokens_total{}"] == before["topg_generation_tokens_total{}"] + 4
    for name in (
        "topg_time_to_first_token_seconds_count{}",
        "topg_e2e_request_latency_seconds_count{}",
    ):
        assert after[name] == before[name] + 1
    assert (
        after["topg_inter_token_latency_seconds_count{}"]
        == before["topg_inter_token_latency_seconds_count{}"] + 3
    )
    assert after["topg_engine_steps_total{}"] > before["topg_engine_steps_total{}"]
    assert after['topg_http_requests_total{"endpoint": "/v1/completions", "status": "200"}'] >= 1
    assert after["topg_kv_blocks_used{}"] == 0


def test_api_key() -> None:
    app = create_app(None, MODEL, api_key="sekret")
    with TestClient(app) as c:
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/health").status_code == 503  # not behind the key


def test_disconnect_mid_stream_aborts(client, engine) -> None:
    aborted = engine.stats()["requests"]["aborted"]
    # Long enough to outlast the disconnect: the tiny model's decode step runs on the
    # decode plan in ~0.1 ms, so 200 tokens could finish before the server sees it.
    req = {"prompt": "long", "max_tokens": 1800, "stream": True, **GREEDY}
    with client.stream("POST", "/v1/completions", json=req) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event: the client goes away
    wait_idle(engine)
    assert engine.stats()["requests"]["aborted"] == aborted + 1


def test_concurrent_requests_match_alone(client, engine) -> None:
    """Four requests at once (batched by the engine) answer what each answers alone."""
    import asyncio

    import httpx2

    prompts = ["one", "two two", "three three three", "four"]
    alone = [t.text for t in engine.generate(prompts, max_new_tokens=8, **GREEDY)]

    async def run() -> list[str]:
        transport = httpx2.ASGITransport(app=client.app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://t") as ac:
            rs = await asyncio.gather(*(
                ac.post("/v1/completions", json={"prompt": p, "max_tokens": 8, **GREEDY})
                for p in prompts
            ))  # fmt: skip
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(run()) == alone


def test_import_torch_topg_does_not_import_fastapi() -> None:
    import subprocess
    import sys

    code = "import sys, torch_topg; torch_topg.Engine; assert 'fastapi' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cli_options() -> None:
    from torch_topg.engine.options import from_cli_args
    from torch_topg.serve.cli import parser, served_name

    args = parser().parse_args(
        ["--max-batch-size", "4", "--kv-cache-memory", "30%", "--dtype", "bfloat16",
         "--no-compile", "--tp-size", "2", "--batch-timeout", "5"]
    )  # fmt: skip
    assert from_cli_args(args) == {
        "max_batch_size": 4, "kv_cache_memory": "30%", "dtype": "bfloat16", "compile": False,
        "tp_size": 2, "batch_timeout": 5.0,
    }  # fmt: skip
    assert served_name(args) == "SmolLM2-135M-Instruct"
    args = parser().parse_args(["--model", "/m/qwen.gguf", "--kv-cache-memory", "1000000"])
    assert from_cli_args(args) == {"kv_cache_memory": 1000000}
    assert served_name(args) == "qwen"


def test_cli_has_a_flag_for_every_engine_option() -> None:
    """The server's flags come from EngineArgs: every option, dicts as JSON."""
    from torch_topg.engine.options import EngineArgs, flag, from_cli_args, names
    from torch_topg.serve.cli import parser

    p = parser()
    flags = {s for a in p._actions for s in a.option_strings}
    assert {flag(n) for n in names()} <= flags
    args = p.parse_args(
        ["--model", "m.gguf", "--quantization", '{"method": "gguf", "int8_activations": true}',
         "--speculative", '{"method": "ngram", "num_speculative_tokens": 3}',
         "--kv-cache-dtype", "int8", "--no-prefix-caching", "--session-ttl", "30"]
    )  # fmt: skip
    opts = from_cli_args(args)
    assert opts == {
        "quantization": {"method": "gguf", "int8_activations": True},
        "speculative": {"method": "ngram", "num_speculative_tokens": 3},
        "kv_cache_dtype": "int8", "prefix_caching": False, "session_ttl": 30.0,
    }  # fmt: skip
    checked = EngineArgs.from_options(opts)
    assert checked.speculative.num_speculative_tokens == 3 and not checked.prefix_caching
    assert from_cli_args(p.parse_args(["--quantization", "gguf"])) == {"quantization": "gguf"}
    # every flag parses a value of its option's kind (None defaults included)
    args = p.parse_args(["--max-model-len", "100", "--max-queue", "3", "--seed", "7",
                         "--max-num-batched-tokens", "64", "--host-kv-memory", "10%",
                         "--disk-kv-path", "/tmp", "--device", "cpu"])  # fmt: skip
    assert from_cli_args(args) == {
        "max_model_len": 100, "max_queue": 3, "seed": 7, "max_num_batched_tokens": 64,
        "host_kv_memory": "10%", "disk_kv_path": "/tmp", "device": "cpu",
    }  # fmt: skip
    EngineArgs.from_options(from_cli_args(args))
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative", "{not json"])


def test_cli_takes_vllm_flag_names() -> None:
    """A `vllm serve` command line's flags for the same options work unchanged."""
    from torch_topg.engine.options import from_cli_args
    from torch_topg.serve.cli import parser

    args = parser().parse_args(
        ["--tensor-parallel-size", "2", "--max-num-seqs", "8", "--no-enable-prefix-caching",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
    )  # fmt: skip
    assert from_cli_args(args) == {
        "tp_size": 2, "max_batch_size": 8, "prefix_caching": False,
        "speculative": {"method": "ngram", "num_speculative_tokens": 2},
    }  # fmt: skip
    assert from_cli_args(parser().parse_args(["--enable-prefix-caching"])) == {
        "prefix_caching": True
    }


def test_disconnect_while_waiting_aborts(client, engine, monkeypatch) -> None:
    """A non-streamed request whose client goes away (raw ASGI: the server's receive
    reports http.disconnect) is aborted in the engine and answered 499. The server polls
    every 10 ms here: at its default 0.5 s the tiny model's 2000 tokens (the decode plan,
    a fraction of a millisecond a step) could all finish before the first poll, answered
    200 (seen once in CI)."""
    import asyncio

    from torch_topg.serve import generation

    monkeypatch.setattr(generation, "DISCONNECT_POLL_S", 0.01)
    aborted = engine.stats()["requests"]["aborted"]
    body = json.dumps({"prompt": "long", "max_tokens": 2000, **GREEDY}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "root_path": "", "query_string": b"", "client": ("test", 1), "server": ("test", 80),
        "headers": [(b"content-type", b"application/json")],
    }  # fmt: skip
    sent: list[dict] = []

    async def run() -> None:
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if pending:
                return pending.pop()
            if engine.stats()["tokens"]["generated"] > generated + 2:  # it has started
                return {"type": "http.disconnect"}
            await asyncio.sleep(3600)  # cancelled by the server's poll
            return {}

        async def send(message: dict) -> None:
            sent.append(message)

        await client.app(scope, receive, send)

    generated = engine.stats()["tokens"]["generated"]
    asyncio.run(run())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    wait_idle(engine)
    assert engine.stats()["requests"]["aborted"] == aborted + 1


# --- the openai client -----------------------------------------------------------------
def test_openai_client(client) -> None:
    """The official client through the in-process TestClient (an httpx2 / httpx client)."""
    openai = pytest.importorskip("openai", reason="the openai package is not installed")
    try:
        oai = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)
    except TypeError as e:  # an openai release that does not take this client type
        pytest.skip(f"openai does not accept the TestClient as its http_client: {e}")
    greedy = {"temperature": 0, "extra_body": {"ignore_eos": True}}
    c = oai.completions.create(model=MODEL, prompt="Hello", max_tokens=5, **greedy)
    assert c.usage.completion_tokens == 5 and c.choices[0].finish_reason == "length"
    chat = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, n=2, **greedy)
    assert len(chat.choices) == 2
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
    stream = oai.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, **greedy,
    )  # fmt: skip
    chunks = list(stream)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError, match="name"):
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES,
            tools=[{"type": "function", "function": {"parameters": {}}}],
        )  # fmt: skip
    assert [m.id for m in oai.models.list()] == [MODEL]


# --- structured outputs on the tiny engine ----------------------------------------------
@pytest.mark.parametrize(
    ("path", "extra", "check"),
    [
        ("/v1/completions", {"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
        (
            "/v1/chat/completions",
            {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}},
            lambda t: re.fullmatch("[a-z]{3}-[0-9]{2}", t),
        ),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_object"}},
            lambda t: isinstance(json.loads(t), dict),
        ),
        (
            "/v1/completions",
            {"grammar": 'root ::= "x" [0-9] "y"'},
            lambda t: re.fullmatch("x[0-9]y", t),
        ),
        ("/v1/completions", {"response_format": {"type": "text"}}, lambda t: isinstance(t, str)),
    ],
)
def test_structured_outputs_streamed_and_not(client, path, extra, check) -> None:
    base = {"max_tokens": 300, "temperature": 0}
    base.update({"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"})
    r = client.post(path, json={**base, **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    assert check(text), text
    if "response_format" in extra and extra["response_format"]["type"] == "text":
        return
    assert choice["finish_reason"] == "stop"
    with client.stream("POST", path, json={**base, **extra, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events[:-1]]
    key = (lambda c: c["delta"].get("content") or "") if "chat" in path else (lambda c: c["text"])
    assert "".join(key(c["choices"][0]) for c in chunks if c["choices"]) == text
