"""Speculative decoding on SmolLM2-135M-Instruct with its real weights: greedy text
identical with and without speculation for prompt lookup and the self-draft, in a mixed
batch (one request opted out), with EOS and stop strings (also split across tokens)
landing inside accepted runs; the pool whole after each test."""

from __future__ import annotations

import pytest
from engine_utils import whole_pool

import torch_topg
from torch_topg.engine import Engine
from torch_topg.models import smollm2_available
from torch_topg.models.hf import smollm2_folder

pytestmark = [
    pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available())),
    pytest.mark.skipif(
        not torch_topg.native_available(),
        reason="needs the native CPU kernels (not built, or TOPG_DISABLE_NATIVE=1)",
    ),
]

TEXT = (
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin "
    "encompasses seven million square kilometers, of which five and a half million are "
    "covered by the rainforest. The region includes territory belonging to nine nations."
)
PROMPTS = [
    [{"role": "user", "content": "Summarise this text, reusing its wording.\n\n" + TEXT}],
    [{"role": "user", "content": "Repeat this sentence exactly: " + TEXT.split(". ")[1]}],
    [{"role": "user", "content": "What is the capital of France?"}],
]
KW = dict(max_batch_size=8, max_model_len=1024, seed=0, compile=False)
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "self": {"method": "self", "num_layers": 8, "num_speculative_tokens": 3, "adaptive": False},
    # a draft loaded from a folder (the target's own checkpoint: every proposal accepted)
    "draft": lambda: {
        "method": "draft",
        "model": str(smollm2_folder()),
        "num_speculative_tokens": 3,
        "adaptive": False,
    },
}


@pytest.fixture(scope="module")
def want():
    with Engine.from_pretrained(**KW) as eng:
        return [o for o in eng.generate(PROMPTS, max_new_tokens=48, temperature=0)]


@pytest.fixture(scope="module", params=list(SPECS))
def engine(request):
    spec = SPECS[request.param]
    with Engine.from_pretrained(speculative=spec() if callable(spec) else spec, **KW) as eng:
        yield eng


def test_greedy_text_identical_in_a_mixed_batch(engine, want):
    with whole_pool(engine):
        handles = [
            engine.submit(p, max_new_tokens=48, temperature=0, speculative=i != 2)
            for i, p in enumerate(PROMPTS)
        ]
        got = [h.result() for h in handles]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    assert got[2].outputs[0].speculative is None
    sp = engine.stats()["speculative"]
    assert sp["proposals"] > 0, sp
    if engine.proposer.cfg.method == "ngram":  # the repeated sentence is found in the prompt
        assert got[1].outputs[0].speculative["mean_accepted_length"] > 1.5
    if engine.proposer.cfg.method == "draft":
        assert sp["acceptance_rate"] == 1.0


def test_stop_strings_inside_accepted_runs(engine, want):
    text, ids = want[1].text, want[1].token_ids
    pieces = [engine.tokenizer.decode([t]) for t in ids]
    stops = [pieces[k][-2:] + pieces[k + 1][:2] for k in (3, 6, 9, 14)
             if len(pieces[k].strip()) >= 2 and len(pieces[k + 1].strip()) >= 2]  # fmt: skip
    stops += [pieces[k].strip() for k in (5, 8) if len(pieces[k].strip()) >= 3]
    assert len(stops) >= 3
    with whole_pool(engine):
        for stop in stops:
            out = engine.generate(PROMPTS[1], max_new_tokens=48, temperature=0, stop=[stop])[0]
            assert out.finish_reason == "stop"
            assert out.text == text[: text.index(stop)]
    if engine.proposer.cfg.method == "ngram":
        assert engine.stats()["speculative"]["mean_accepted_length"] > 1.5
