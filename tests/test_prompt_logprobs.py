"""Prompt logprobs (engine and server) and ``echo`` on /v1/completions: each prompt
token's logprob given the ones before, equal to transformers' forward on the same model
(chunked prefill, a cached prefix, ``n > 1``), and OpenAI's legacy echo format."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from engine_utils import wait_idle
from test_serve import MODEL, chat_engine

try:
    from fastapi.testclient import TestClient
except (ImportError, RuntimeError) as e:  # starlette's TestClient needs httpx
    pytest.skip(f"fastapi's TestClient is unavailable: {e}", allow_module_level=True)

from torch_topg.serve import create_app

IDS = list(range(5, 31))  # 26 tokens: several chunks at max_num_batched_tokens=8


@pytest.fixture(scope="module")
def engine():
    with chat_engine(max_num_batched_tokens=8) as eng:
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


def reference(engine, ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax of every position (the model, on its own attention)."""
    model = copy.deepcopy(engine.model)
    model.set_attn_implementation("sdpa")
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check(engine, ids, got, k) -> None:
    ref = reference(engine, ids)
    assert len(got) == len(ids) and got[0] is None
    for p, t in enumerate(got[1:]):
        row = ref[p]
        assert t.token_id == ids[p + 1]
        assert t.logprob == pytest.approx(row[ids[p + 1]].item(), abs=1e-4)
        assert t.rank == int((row > row[ids[p + 1]]).sum()) + 1
        vals, top = row.topk(k)
        assert list(t.top) == top.tolist()
        assert list(t.top.values()) == pytest.approx(vals.tolist(), abs=1e-4)


def test_engine_prompt_logprobs_equal_transformers(engine) -> None:
    plain = engine.generate([IDS], max_new_tokens=4, temperature=0)[0]
    assert plain.prompt_logprobs is None
    out = engine.generate([IDS], max_new_tokens=4, temperature=0, prompt_logprobs=3)[0]
    check(engine, IDS, out.prompt_logprobs, 3)
    assert out.token_ids == plain.token_ids  # the sampled rows are the same
    # its prefix is cached now: a request asking prompt logprobs still computes it all
    again = engine.generate([IDS], max_new_tokens=4, temperature=0, prompt_logprobs=3)[0]
    assert again.cached_prompt_tokens == 0 and again.token_ids == plain.token_ids
    check(engine, IDS, again.prompt_logprobs, 3)
    assert engine.generate([IDS], max_new_tokens=1)[0].cached_prompt_tokens > 0


def test_engine_prompt_logprobs_in_a_batch_and_n(engine) -> None:
    other = IDS[3:20]
    hs = [
        engine.submit(IDS, max_new_tokens=3, temperature=1.0, n=3, seed=1, prompt_logprobs=0),
        engine.submit(other, max_new_tokens=3, temperature=0),
    ]
    a, b = (h.result() for h in hs)
    check(engine, IDS, a.prompt_logprobs, 0)
    assert len(a.outputs) == 3 and b.prompt_logprobs is None
    assert b.token_ids == engine.generate([other], max_new_tokens=3, temperature=0)[0].token_ids


def test_engine_refuses_bad_prompt_logprobs(engine) -> None:
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.submit(IDS, prompt_logprobs=bad)


def test_completions_prompt_logprobs(client, engine) -> None:
    r = client.post("/v1/completions", json={"prompt": IDS, "max_tokens": 2,
                                             "temperature": 0, "prompt_logprobs": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ref = reference(engine, IDS)
    assert plp[0] is None and len(plp) == len(IDS)
    for p, entry in enumerate(plp[1:]):
        mine = entry[str(IDS[p + 1])]
        assert mine["logprob"] == pytest.approx(ref[p, IDS[p + 1]].item(), abs=1e-4)
        assert mine["decoded_token"] == engine.tokenizer.decode([IDS[p + 1]])
        assert {v["rank"] for v in entry.values()} == {1, 2, mine["rank"]}


def test_chat_prompt_logprobs(client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "prompt_logprobs": 1}  # fmt: skip
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    plp = r.json()["prompt_logprobs"]
    assert plp[0] is None and all(isinstance(e, dict) for e in plp[1:])
    r = client.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_echo(client, engine) -> None:
    base = {"prompt": "Hello there", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = client.post("/v1/completions", json=base).json()["choices"][0]
    echoed = client.post("/v1/completions", json={**base, "echo": True}).json()["choices"][0]
    assert echoed["text"] == "Hello there" + plain["text"]
    r = client.post("/v1/completions", json={**base, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    ids = engine.tokenizer.encode("Hello there", add_special_tokens=True)
    n = len(ids)
    assert len(lp["tokens"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    ref = reference(engine, ids)
    for p in range(1, n):
        assert lp["token_logprobs"][p] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert len(lp["top_logprobs"][p]) <= 2
    offs = lp["text_offset"]
    assert offs == sorted(offs) and offs[0] == 0
    assert offs[n] == len("Hello there")  # the choice's own tokens start after the echo


def test_echo_streamed_equals_whole(client) -> None:
    base = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "echo": True, "logprobs": 1}  # fmt: skip
    whole = client.post("/v1/completions", json=base).json()["choices"][0]
    text, tokens, values = "", [], []
    with client.stream("POST", "/v1/completions", json={**base, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            (ch,) = json.loads(line[6:])["choices"]
            text += ch["text"]
            if ch["logprobs"]:
                tokens += ch["logprobs"]["tokens"]
                values += ch["logprobs"]["token_logprobs"]
    assert text == whole["text"]
    assert tokens == whole["logprobs"]["tokens"]
    assert values == whole["logprobs"]["token_logprobs"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"echo": "yes"}, "echo"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ],
)
def test_bad_fields(client, body, param) -> None:
    r = client.post("/v1/completions", json={"prompt": "a", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_one_chunk_on_the_model_graph() -> None:
    """The whole prompt in one step (26 tokens: the graph, not the decode plan's steps
    of at most 16 that the chunked engine above runs)."""
    with chat_engine(max_num_batched_tokens=64) as eng:
        out = eng.generate([IDS], max_new_tokens=2, temperature=0, prompt_logprobs=4)[0]
        check(eng, IDS, out.prompt_logprobs, 4)
        wait_idle(eng)
        eng.pool.check_whole()
