"""``skip_special_tokens`` (vLLM's request field, default true) and Mistral's tool calls,
whose ``[TOOL_CALLS]`` marker is a special token.

The model is a tiny Llama rigged into a bigram table (hidden states carry the one-hot
input token through zeroed attention and MLP outputs; the LM head maps each token to its
successor), so greedy decoding writes a known Mistral tool-call answer after ``[/INST]``.
The tokenizer (``tokenizers``' WordLevel, wrapped by transformers) has ``[TOOL_CALLS]``,
``[INST]``, ``[/INST]`` and ``</s>`` as special tokens. The engine's text is checked
against the tokenizer's own ``decode`` of the same ids, and the server, with the Mistral
template and parser, returns the call: the parser saw ``[TOOL_CALLS]`` although the
request did not ask for special tokens (the server turns skipping off, as vLLM does)."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")

from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from torch_topg.engine import Engine
from torch_topg.serve import create_app
from torch_topg.serve.chat_template import ChatOptions, load_chat_template

SPECIAL = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]"]
# the answer, token by token, after [/INST]; every token once (a bigram chain)
ANSWER = ["[TOOL_CALLS]", '[{"name": "get_weather", ', '"arguments": {"city": ', '"Paris"}}]',
          "</s>"]  # fmt: skip
WORDS = ["hello", "weather", "Paris", ANSWER[1], ANSWER[2], ANSWER[3]]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.Fuse()  # tokens joined as they are
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")  # fmt: skip
    fast.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]", "[TOOL_CALLS]"]})
    return fast


def _bigram_model(tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    """Greedy: ``[/INST]`` -> ANSWER[0] -> ANSWER[1] -> ... -> ``</s>``; others -> ``</s>``."""
    n = len(tok)
    cfg = LlamaConfig(vocab_size=n, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, eos_token_id=2,
                      bos_token_id=1, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    ids = tok.convert_tokens_to_ids(["[/INST]", *ANSWER])
    nxt = dict(itertools.pairwise(ids))
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :n] = torch.eye(n)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for i in range(n):
            model.lm_head.weight[nxt.get(i, 2), i] = 1.0
    return model


@pytest.fixture(scope="module")
def engine():
    tok = _tokenizer()
    with Engine.from_model(_bigram_model(tok), tok, compile=False, block_size=4) as eng:
        yield eng


def test_engine_text_keeps_special_tokens_when_asked(engine) -> None:
    tok = engine.tokenizer
    prompt = tok.convert_tokens_to_ids(["<s>", "[INST]", "hello", "[/INST]"])
    greedy = dict(max_new_tokens=10, temperature=0.0)
    kept = engine.generate([prompt], skip_special_tokens=False, **greedy)[0].outputs[0]
    want = tok.convert_tokens_to_ids(ANSWER)
    assert kept.token_ids == want and kept.finish_reason == "stop"
    # the tokenizer's own decode, less the EOS that ended the sample (vLLM's rule)
    assert kept.text == tok.decode(want[:-1], skip_special_tokens=False)
    assert kept.text.startswith("[TOOL_CALLS][{")
    skipped = engine.generate([prompt], **greedy)[0].outputs[0]
    assert skipped.text == tok.decode(want, skip_special_tokens=True)
    assert "[TOOL_CALLS]" not in skipped.text
    with pytest.raises(ValueError, match="skip_special_tokens must be a bool"):
        engine.submit(prompt, skip_special_tokens="no")


def test_mistral_tool_call_reaches_the_parser(engine) -> None:
    chat = ChatOptions(load_chat_template("mistral"), "mistral")
    with TestClient(create_app(engine, "bigram", chat=chat)) as c:
        body = {"messages": [{"role": "user", "content": "weather Paris"}], "tools": [TOOL],
                "temperature": 0, "max_tokens": 10}  # fmt: skip
        r = c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
        assert not choice["message"]["content"]
        # streamed: the same call, reassembled
        args, names = "", []
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for d in json.loads(line[6:])["choices"]:
                        for t in d["delta"].get("tool_calls") or []:
                            names += [t["function"]["name"]] if t["function"].get("name") else []
                            args += t["function"].get("arguments") or ""
        assert names == ["get_weather"] and json.loads(args) == {"city": "Paris"}
        # without tools the field is the client's: special tokens dropped by default
        plain = {**body, "tools": None}
        text = c.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
        assert "[TOOL_CALLS]" not in text["content"]
        comp = {"prompt": "[INST] hello [/INST]", "max_tokens": 10, "temperature": 0,
                "skip_special_tokens": False}  # fmt: skip
        out = c.post("/v1/completions", json=comp).json()["choices"][0]["text"]
        assert out.startswith("[TOOL_CALLS][{")
        bad = c.post("/v1/completions", json={**comp, "skip_special_tokens": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "skip_special_tokens"
