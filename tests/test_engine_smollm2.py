"""The engine on SmolLM2-135M-Instruct with its real weights (the embedded default):
greedy text equals transformers ``generate``, alone and batched with late arrivals;
chat messages through the chat template; stop strings, also split across tokens;
streamed text deltas add up to the final text."""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_utils import hf_greedy, whole_pool

import torch_topg
from torch_topg.engine import Engine
from torch_topg.models import load_smollm2, smollm2_available

pytestmark = [
    pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available())),
    # The reference fallback (TOPG_DISABLE_NATIVE=1) runs a 135M model at ~0.5 s a token;
    # the tiny-model engine tests cover that path.
    pytest.mark.skipif(
        not torch_topg.native_available(),
        reason="needs the native CPU kernels (not built, or TOPG_DISABLE_NATIVE=1)",
    ),
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in two sentences.",
]


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained(max_batch_size=8, max_model_len=1024, seed=0) as eng:
        yield eng


@pytest.fixture(scope="module")
def reference():
    model, tok = load_smollm2()
    return model, tok


def _chat_ids(tok, q):
    text = tok.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
    )
    return tok.encode(text, add_special_tokens=False)


def test_greedy_text_matches_transformers(engine, reference):
    model, tok = reference
    ids = [_chat_ids(tok, q) for q in QUESTIONS]
    want = [hf_greedy(model, p, 24) for p in ids]
    with whole_pool(engine):
        alone = engine.generate([ids[0]], max_new_tokens=24, temperature=0, ignore_eos=True)[0]
        assert alone.token_ids == want[0]
        handles, streams = [], []
        for p in ids:  # each arrives while the previous ones decode
            handles.append(engine.submit(p, max_new_tokens=24, temperature=0, ignore_eos=True))
            streams.append(iter(handles[-1]))
            next(streams[-1])
        outs = [h.result() for h in handles]
    assert [o.token_ids for o in outs] == want
    assert outs[0].text == tok.decode(want[0], skip_special_tokens=True)
    assert engine.stats()["compile"]["while_serving"] == 0


def test_chat_messages_and_stream(engine, reference):
    _, tok = reference
    msgs = [{"role": "user", "content": QUESTIONS[0]}]
    with whole_pool(engine):
        out = engine.generate(msgs, max_new_tokens=20, temperature=0)[0]
        assert out.prompt_token_ids == _chat_ids(tok, QUESTIONS[0])
        assert "Paris" in out.text
        assert "".join(engine.stream(msgs, max_new_tokens=20, temperature=0)) == out.text

        async def collect():
            return [t async for t in engine.stream_generate(msgs, max_new_tokens=20, temperature=0)]

        assert "".join(asyncio.run(collect())) == out.text


def test_stop_strings_also_split_across_tokens(engine):
    msgs = [{"role": "user", "content": QUESTIONS[2]}]
    free = engine.generate(msgs, max_new_tokens=40, temperature=0, ignore_eos=True)[0]
    text = free.text
    # A stop string that spans a token boundary: the end of one token and the start of
    # the next (each non-empty, printable).
    pieces = [engine.tokenizer.decode([t]) for t in free.token_ids]
    k = next(
        i
        for i in range(2, len(pieces) - 1)
        if len(pieces[i].strip()) >= 2 and len(pieces[i + 1].strip()) >= 2
    )
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    assert stop in text
    with whole_pool(engine):
        out = engine.generate(msgs, max_new_tokens=40, temperature=0, ignore_eos=True, stop=[stop])[
            0
        ]
        assert out.finish_reason == "stop"
        assert out.text == text[: text.index(stop)]
        streamed = "".join(
            engine.stream(msgs, max_new_tokens=40, temperature=0, ignore_eos=True, stop=stop)
        )
        assert streamed == out.text


def test_eos_ends_chat_answer(engine):
    out = engine.generate(
        [{"role": "user", "content": "Say hi."}], max_new_tokens=64, temperature=0
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine._eos
    assert out.ttft is not None and len(out.outputs[0].token_times) == len(out.token_ids)


def test_seeded_sampling_reproducible_under_load(engine):
    msgs = [{"role": "user", "content": QUESTIONS[1]}]
    kw = dict(max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=7)
    a = engine.generate(msgs, **kw)[0]
    others = [engine.submit(q, max_new_tokens=30, temperature=1.0) for q in QUESTIONS]
    b = engine.generate(msgs, **kw)[0]
    for h in others:
        h.result()
    assert a.token_ids == b.token_ids
    c = engine.generate(msgs, **{**kw, "seed": 8})[0]
    assert c.token_ids != a.token_ids
    assert torch.tensor(a.token_ids).numel() == 24 or a.finish_reason == "stop"
