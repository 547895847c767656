"""Structured outputs in the engine (tiny seeded Llama on a byte-level tokenizer): greedy
answers under a choice, a regex and a JSON schema always match; constrained and free rows
share a batch without changing the free row; ``n > 1``, prefix reuse and sessions;
speculative decoding gives the same greedy answers with its proposals rejected by the
grammar; a grammar that cannot finish ends with "length"; the mask the sampler applies
equals one built by asking the matcher about every token (hypothesis)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
import xgrammar as xgr
from engine_utils import tiny, whole_pool
from hypothesis import given, settings
from hypothesis import strategies as st
from test_serve import SPECIALS, byte_tokenizer

from torch_topg.engine import Engine
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.structured import GrammarCompiler, Structured, allowed_mask, apply_bitmask

GREEDY = dict(temperature=0)
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["red", "green"]},
        "extra": {"type": "string", "maxLength": 3},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
CHOICES = ["yes", "no", "it depends"]
REGEX = r"[a-z]{2,5}-[0-9]{1,3}"
PROMPTS = ["Hello there", "What is it?", "Say something", "JSON please"]


def _model():
    tok = byte_tokenizer()
    ids = {s: tok.convert_tokens_to_ids(s) for s in SPECIALS}
    model = tiny(
        "llama-tiny", vocab_size=len(tok), bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"],
    )  # fmt: skip
    return model, tok


def _engine(**options):
    model, tok = _model()
    return Engine.from_model(
        model, tok, **{"block_size": 4, "compile": False, "seed": 0, **options}
    )


@pytest.fixture(scope="module")
def engine():
    with _engine() as eng:
        yield eng


def _valid(spec: Structured, text: str) -> bool:
    if spec.kind == "choice":
        return text in spec.value
    if spec.kind == "regex":
        return re.fullmatch(spec.value, text) is not None
    doc = json.loads(text)
    if spec.kind == "json_schema":
        jsonschema.validate(doc, json.loads(spec.value))
    return isinstance(doc, dict)


SPECS = [
    Structured.choice(CHOICES),
    Structured.regex(REGEX),
    Structured.json_schema(SCHEMA),
    Structured.json_object(),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_greedy_answers_match(engine, spec):
    with whole_pool(engine):
        outs = engine.generate(PROMPTS, max_new_tokens=400, structured=spec, **GREEDY)
    for o in outs:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
        assert _valid(spec, o.text), o.text


def test_free_row_unchanged_beside_constrained_rows(engine):
    free = dict(max_new_tokens=24, ignore_eos=True, **GREEDY)
    alone = engine.generate(["The free one"], **free)[0].token_ids
    with whole_pool(engine):
        handles = [
            engine.submit(p, max_new_tokens=60, structured=s, **GREEDY)
            for p, s in zip(PROMPTS, SPECS[:3], strict=False)
        ]
        mixed = engine.submit("The free one", **free)
        handles += [engine.submit(PROMPTS[0], max_new_tokens=60, structured=SPECS[1], **GREEDY)]
        assert mixed.result().token_ids == alone
        for h in handles:
            h.result()
    st = engine.stats()["structured"]
    assert st["steps"] > 0 and st["rows"] >= st["steps"] and st["compiled"] >= 3
    assert 0.0 <= st["mask_hidden_fraction"] <= 1.0
    assert st["mask_ms_p90"] >= 0.0 and st["mask_exposed_ms_mean"] <= st["mask_ms_mean"] + 1e-9


@pytest.mark.parametrize("overlap", [True, False], ids=["worker", "in-line"])
def test_masks_filled_beside_the_forward_or_in_line_agree(engine, overlap):
    """Both places the masks are filled (a worker thread beside the forward where a core
    is free, else in line before sampling) give the same answers."""
    import threading

    before = engine.constraints.overlap
    engine.constraints.overlap = overlap
    try:
        with whole_pool(engine):
            got = engine.generate(PROMPTS, max_new_tokens=60, structured=SPECS[2], **GREEDY)
        workers = [t for t in threading.enumerate() if t.name.startswith("topg-masks")]
    finally:
        engine.constraints.overlap = before
    with whole_pool(engine):
        engine.constraints.overlap = not overlap
        try:
            other = engine.generate(PROMPTS, max_new_tokens=60, structured=SPECS[2], **GREEDY)
        finally:
            engine.constraints.overlap = before
    assert [o.token_ids for o in got] == [o.token_ids for o in other]
    assert all(_valid(SPECS[2], o.text) for o in got if o.finish_reason == "stop")
    assert bool(workers) or not overlap  # the worker: one thread for the engine's life


def test_n_samples_all_match(engine):
    spec = Structured.regex(REGEX)
    with whole_pool(engine):
        out = engine.generate("Many", n=4, temperature=1.0, seed=3, max_new_tokens=40,
                              structured=spec)[0]  # fmt: skip
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(REGEX, c.text), c.text
    # greedy samples are the same answer
    with whole_pool(engine):
        g = engine.generate("Many", n=3, max_new_tokens=40, structured=spec, **GREEDY)[0]
    assert len({c.text for c in g.outputs}) == 1


def test_prefix_reuse_and_session(engine):
    prompt = "A long shared prefix that fills several blocks of four tokens, then a question"
    spec = Structured.choice(CHOICES)
    with whole_pool(engine):
        first = engine.generate(prompt, max_new_tokens=20, structured=spec, session_id="s1",
                                **GREEDY)[0]  # fmt: skip
        again = engine.generate(prompt, max_new_tokens=20, structured=spec, session_id="s1",
                                **GREEDY)[0]  # fmt: skip
    assert again.cached_prompt_tokens > 0
    assert again.text == first.text and first.text in CHOICES
    engine.close_session("s1")


def test_grammar_that_cannot_finish_ends_with_length(engine):
    with whole_pool(engine):
        out = engine.generate("Go", max_new_tokens=5, structured=Structured.regex("[a-z]{40}"),
                              **GREEDY)[0]  # fmt: skip
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch("[a-z]{5}", out.text)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (dict(kind="regex", value="a(b"), "does not compile"),
        (dict(kind="grammar", value="root ::= undefined_rule"), "does not compile"),
        (dict(kind="json_schema", value={"type": "nonsense"}), "does not compile"),
        (dict(kind="json_schema", value="{not json"), "schema"),
        (dict(kind="choice", value=[]), "non-empty list"),
        (dict(kind="xml", value="x"), "kind"),
    ],
)
def test_bad_specs_are_refused_naming_structured(engine, spec, words):
    with pytest.raises(ParameterError, match=words) as e:
        engine.submit("x", max_new_tokens=2, structured=spec)
    assert e.value.param == "structured"


def test_no_tokenizer_is_refused():
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng:
        with pytest.raises(ParameterError, match="tokenizer"):
            eng.submit([5, 6, 7], max_new_tokens=2, structured=Structured.regex("a+"))


def test_speculative_gives_the_same_greedy_answers(engine):
    """A draft with the target's own weights proposes the target's unconstrained argmax:
    where the grammar forbids it, the proposal is rejected (and the matcher rolled back)."""
    ps = [*PROMPTS, "Hello there Hello there Hello there"]
    specs = [SPECS[0], SPECS[1], SPECS[2], SPECS[1], SPECS[0]]
    kw = dict(max_new_tokens=200, **GREEDY)
    want = [
        engine.generate(p, structured=s, **kw)[0].token_ids for p, s in zip(ps, specs, strict=True)
    ]
    draft, _ = _model()
    spec = {"method": "draft", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    with _engine(speculative=spec) as eng:
        with whole_pool(eng):
            handles = [eng.submit(p, structured=s, **kw) for p, s in zip(ps, specs, strict=True)]
            got = [h.result().token_ids for h in handles]
        sp = eng.stats()["speculative"]
    assert got == want
    assert sp["proposals"] > 0
    assert 0 < sp["accepted_tokens"] < sp["proposed_tokens"]  # the grammar rejected some


# --------------------------------------------------------------------------- the mask

GRAMMARS = [
    Structured.choice(["cat", "car", "dog!"]),
    Structured.regex(r"(ab|a[0-9])+c?"),
    Structured.json_schema(
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    ),
    Structured.grammar('root ::= "(" root ")" | "x"'),
]
WIDTH = 288  # the model's logits width: 259 tokenizer ids, then padding


@pytest.fixture(scope="module")
def compiler():
    tok = byte_tokenizer()
    return GrammarCompiler(tok, WIDTH, [tok.convert_tokens_to_ids("<|im_end|>")])


@settings(max_examples=30, deadline=None)
@given(which=st.integers(0, len(GRAMMARS) - 1), walk=st.lists(st.integers(0, 10**6), max_size=6))
def test_mask_equals_the_matchers_answer_for_each_token(compiler, which, walk):
    m = xgr.GrammarMatcher(compiler.compile(GRAMMARS[which]))
    bitmask = torch.full((1, -(-WIDTH // 32)), -1, dtype=torch.int32)
    for r in walk:  # a random path through the grammar, then the mask against a reference
        if m.is_terminated():
            break
        m.fill_next_token_bitmask(bitmask, 0)
        ok = allowed_mask(bitmask, WIDTH)[0].nonzero().flatten().tolist()
        assert ok, "a live matcher allows some token"
        assert m.accept_token(ok[r % len(ok)])
    if m.is_terminated():
        return
    m.fill_next_token_bitmask(bitmask, 0)
    got = allowed_mask(bitmask, WIDTH)[0]
    want = torch.tensor([m.fork().accept_token(t) for t in range(WIDTH)])
    assert torch.equal(got, want)
    assert not got[259:].any()  # padded ids: never
    logits = torch.randn(2, WIDTH)
    masked = apply_bitmask(logits, bitmask, [1])
    assert torch.equal(masked[0], logits[0])
    assert torch.equal(torch.isneginf(masked[1]), ~want)
    assert torch.equal(masked[1][want], logits[1][want])


def test_compiled_grammars_are_cached(compiler):
    spec = Structured.regex("[0-9]+z")
    before = compiler.stats()
    a = compiler.compile(spec)
    b = compiler.compile(Structured("regex", "[0-9]+z"))
    assert a is b
    after = compiler.stats()
    assert after["compiled"] == before["compiled"] + 1
    assert after["cache_hits"] == before["cache_hits"] + 1


def test_integers_get_json_safe_bounds():
    from torch_topg.engine.structured import SAFE_INTEGER, bounded_integers

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": ["integer", "null"], "minimum": 3},
            "c": {"type": "integer", "exclusiveMaximum": 10},
            "d": {"const": {"type": "integer"}},
        },
    }
    got = bounded_integers(schema)["properties"]
    assert got["a"] == {"type": "integer", "minimum": -SAFE_INTEGER, "maximum": SAFE_INTEGER}
    assert got["b"]["minimum"] == 3 and got["b"]["maximum"] == SAFE_INTEGER
    assert "maximum" not in got["c"] and got["c"]["minimum"] == -SAFE_INTEGER
    assert got["d"] == {"const": {"type": "integer"}}  # data, not a schema
    assert schema["properties"]["a"] == {"type": "integer"}  # the input is not changed
