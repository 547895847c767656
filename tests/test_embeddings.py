"""Embeddings: ``Engine.embed`` against transformers' final hidden states on tiny random
decoders (last-token and mean pooling, L2-normalised), batches split by the token budget,
and ``POST /v1/embeddings`` with the official ``openai`` client (float and base64) and
its bad inputs."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_utils import prompts, tiny
from test_serve import MODEL, chat_engine

from torch_topg.engine import Engine

INPUTS = prompts(3, [9, 23, 2, 14])


def reference(model, ids: list[int], pooling: str) -> torch.Tensor:
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    with torch.inference_mode():
        h = ref.get_decoder()(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if pooling == "last" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=-1)


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny"])
@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_equals_transformers(preset, pooling) -> None:
    model = tiny(preset)
    # a budget of 16 tokens: the inputs go in several batches, the 23-token one alone
    with Engine.from_model(model, None, compile=False, block_size=4,
                           max_num_batched_tokens=16) as eng:  # fmt: skip
        vecs = eng.embed(INPUTS, pooling=pooling)
        assert vecs.shape == (len(INPUTS), model.config.hidden_size)
        assert vecs.dtype == torch.float32
        for v, ids in zip(vecs, INPUTS, strict=True):
            torch.testing.assert_close(v, reference(eng.model, ids, pooling), atol=2e-5, rtol=1e-4)
        assert torch.linalg.vector_norm(vecs, dim=-1) == pytest.approx([1.0] * len(INPUTS))
        raw = eng.embed(INPUTS[0], pooling=pooling, normalize=False)
        assert raw.shape == (1, model.config.hidden_size)
        assert float(torch.linalg.vector_norm(raw)) != pytest.approx(1.0)
        # the KV pool is untouched and generation goes on
        assert eng.pool.num_used == 0
        # (ignore_eos: the random model samples its EOS now and then, which ended one run at 2)
        out = eng.generate([INPUTS[0]], max_new_tokens=3, ignore_eos=True)
        assert len(out[0].token_ids) == 3


def test_embed_refuses_bad_arguments() -> None:
    with chat_engine() as eng:
        with pytest.raises(ValueError, match="pooling"):
            eng.embed("hi", pooling="cls")
        with pytest.raises(ValueError, match="input"):
            eng.embed([[5] * (eng.config.max_model_len + 1)])


# --- the server ---------------------------------------------------------------------------
import openai  # noqa: E402  (the test extra)

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
from fastapi.testclient import TestClient  # noqa: E402
from test_serve_tools import serving  # noqa: E402

from torch_topg.serve import create_app  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with chat_engine() as eng, serving(create_app(eng, MODEL)) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            yield client, eng


def test_openai_client_embeddings(served) -> None:
    client, eng = served
    texts = ["Hello there", "the sky is blue", "x"]
    r = client.embeddings.create(model=MODEL, input=texts)  # the client asks base64
    assert [d.index for d in r.data] == [0, 1, 2] and r.model == MODEL
    ids = [eng.tokenizer.encode(t, add_special_tokens=True) for t in texts]
    for d, x in zip(r.data, ids, strict=True):
        got = torch.tensor(d.embedding)
        torch.testing.assert_close(got, reference(eng.model, x, "last"), atol=2e-5, rtol=1e-4)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    floats = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    for a, b in zip(floats.data, r.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, abs=1e-6)
    one = client.embeddings.create(model=MODEL, input=ids[1], dimensions=64)
    assert one.data[0].embedding == pytest.approx(r.data[1].embedding, abs=1e-6)


def test_mean_pooling_server() -> None:
    with chat_engine() as eng, TestClient(create_app(eng, MODEL, pooling="mean")) as c:
        r = c.post("/v1/embeddings", json={"input": [5, 6, 7, 8]})
        assert r.status_code == 200, r.text
        want = reference(eng.model, [5, 6, 7, 8], "mean")
        torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), want,
                                   atol=2e-5, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["a", 3]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [10**9]}, "input"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 8}, "dimensions"),
        ({"input": "a", "model": "other"}, "model"),
        ({"input": "a", "pooling": "mean"}, "pooling"),
    ],
)
def test_bad_embedding_bodies(served, body, param) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/embeddings", body=body, cast_to=object)
    assert e.value.body["param"] == param
