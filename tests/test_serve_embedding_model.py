"""A separate embedding model served with ``--model`` (``--task embed``): a tiny random
Qwen3 decoder saved as Qwen3-Embedding is (a base ``Qwen3Model`` with a
sentence-transformers last-token pooling and a Normalize module). ``/v1/embeddings``
returns transformers' own final hidden states of each input alone, last token, L2-
normalised; the task is detected from the folder as vLLM detects it; generation
endpoints answer 400; engine options an embedding model cannot use are refused."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")

from fastapi.testclient import TestClient
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    AutoModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3Model,
)

from torch_topg.engine.embedding_model import EmbeddingModel, is_embedding_model
from torch_topg.serve import create_app
from torch_topg.serve.cli import parser, task_of

WORDS = ["<unk>", "<|endoftext|>", "the", "cat", "sat", "on", "a", "mat", "dogs", "run", "fast"]
INPUTS = ["the cat sat on a mat", "dogs run fast", "cat"]


def _tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   eos_token="<|endoftext|>")  # fmt: skip


def _config() -> Qwen3Config:
    return Qwen3Config(vocab_size=len(WORDS), hidden_size=64, intermediate_size=96,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=128)  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Qwen3-Embedding's layout: a base model, a tokenizer, sentence-transformers files."""
    path = tmp_path_factory.mktemp("qwen3-embedding-tiny")
    torch.manual_seed(0)
    Qwen3Model(_config()).save_pretrained(path)
    _tokenizer().save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]))  # fmt: skip
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": False,
         "pooling_mode_lasttoken": True}))  # fmt: skip
    return path


def _reference(folder, text: str) -> torch.Tensor:
    """transformers' own hidden states of ``text`` alone, last token, L2-normalised."""
    model = AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    ids = _tokenizer()(text, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        h = model(input_ids=ids).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(h, dim=-1)


def test_embeddings_equal_transformers_last_token(folder) -> None:
    model = EmbeddingModel.from_pretrained(folder)
    assert model.pooling.pooling == "last" and model.pooling.normalize
    with TestClient(create_app(model, "tiny-embed")) as c:
        r = c.post("/v1/embeddings", json={"input": INPUTS})
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["index"] for d in data] == [0, 1, 2]
        for d, text in zip(data, INPUTS, strict=True):
            got = torch.tensor(d["embedding"])
            torch.testing.assert_close(got, _reference(folder, text), atol=2e-5, rtol=1e-4)
        # base64 (the openai client's default) decodes to the same floats
        b = c.post("/v1/embeddings", json={"input": INPUTS[1], "encoding_format": "base64"})
        raw = np.frombuffer(base64.b64decode(b.json()["data"][0]["embedding"]), dtype="<f4")
        torch.testing.assert_close(torch.from_numpy(raw.copy()), torch.tensor(data[1]["embedding"]))
        assert r.json()["usage"]["prompt_tokens"] == sum(len(t.split()) for t in INPUTS)
        assert c.get("/health").status_code == 200
        card = c.get("/v1/models").json()["data"][0]
        assert card["id"] == "tiny-embed" and card["max_model_len"] == 128
        gen = c.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
        assert gen.status_code == 400 and "embedding model" in gen.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}]}).status_code == 400  # fmt: skip
        long = c.post("/v1/embeddings", json={"input": [[2] * 129]})
        assert long.status_code == 400 and long.json()["error"]["param"] == "input"


def test_task_is_detected_as_vllm_does(folder, tmp_path) -> None:
    assert is_embedding_model(folder)
    assert task_of(parser().parse_args(["--model", str(folder)])) == "embed"
    causal = tmp_path / "causal"
    Qwen3ForCausalLM(_config()).save_pretrained(causal)  # architectures: Qwen3ForCausalLM
    assert not is_embedding_model(causal)
    assert task_of(parser().parse_args(["--model", str(causal)])) == "generate"
    for flags in (["--task", "embed"], ["--runner", "pooling"]):
        assert task_of(parser().parse_args(["--model", str(causal), *flags])) == "embed"
    bare = tmp_path / "bare"  # no sentence-transformers files: the architecture decides
    Qwen3Model(_config()).save_pretrained(bare)
    assert task_of(parser().parse_args(["--model", str(bare)])) == "embed"
    with pytest.raises(ValueError, match="contradict"):
        task_of(parser().parse_args(["--model", str(bare), "--task", "generate",
                                     "--runner", "pooling"]))  # fmt: skip
    with pytest.raises(ValueError, match="--kv-cache-dtype: not used by an embedding model"):
        task_of(parser().parse_args(["--model", str(bare), "--kv-cache-dtype", "int8"]))
    mean = tmp_path / "mean"  # a mean-pooling sentence-transformers folder
    Qwen3Model(_config()).save_pretrained(mean)
    _tokenizer().save_pretrained(mean)
    (mean / "modules.json").write_text(json.dumps(
        [{"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))  # fmt: skip
    (mean / "1_Pooling").mkdir()
    (mean / "1_Pooling" / "config.json").write_text('{"pooling_mode_mean_tokens": true}')
    m = EmbeddingModel.from_pretrained(mean)
    assert m.pooling.pooling == "mean" and not m.pooling.normalize
    raw = AutoModel.from_pretrained(mean).eval()
    ids = _tokenizer()(INPUTS[0], return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        want = raw(input_ids=ids).last_hidden_state[0].mean(0)
    torch.testing.assert_close(m.embed(INPUTS[0])[0], want, atol=2e-5, rtol=1e-4)
