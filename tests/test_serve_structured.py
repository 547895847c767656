"""Structured outputs through the official ``openai`` client against the server on
loopback, SmolLM2-135M-Instruct's real weights: schemas from the corpus
(tests/data/json_schemas.json; the whole corpus runs in
python/benchmarks/structured_outputs.py, 44-125 s here), the SDK's ``parse()`` with a
pydantic model, regex and choice (streamed and not), and 400s naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import torch_topg
from torch_topg.models import smollm2_available

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")
import jsonschema
import openai
import pydantic
import xgrammar  # noqa: F401  (the hf extra: structured outputs)

pytestmark = [
    pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available())),
    pytest.mark.skipif(
        not torch_topg.native_available(),
        reason="needs the native CPU kernels (not built, or TOPG_DISABLE_NATIVE=1)",
    ),
]

MODEL = "smollm2"
CORPUS = json.loads((Path(__file__).parent / "data" / "json_schemas.json").read_text())
# a handful of the corpus, each shape once: nested objects, arrays with minItems, enums,
# anyOf, bounded numbers, optional keys
HANDFUL = ["person", "todo", "sentiment", "contact", "order", "nested"]


@pytest.fixture(scope="module")
def served():
    from test_serve_tools import serving

    from torch_topg.engine import Engine
    from torch_topg.serve import create_app

    with Engine.from_pretrained(max_batch_size=8, max_model_len=1024, seed=0) as eng:
        with serving(create_app(eng, MODEL)) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0) as client:
                yield client, eng


def _ask(client, prompt: str, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, **kw
    )


def test_corpus_file_shape():
    assert len(CORPUS) >= 30
    for case in CORPUS:
        jsonschema.Draft202012Validator.check_schema(case["schema"])
        assert case["schema"]["additionalProperties"] is False


def test_schemas_answer_valid_json(served):
    client, eng = served
    cases = [c for c in CORPUS if c["name"] in HANDFUL]

    def one(case):
        rf = {"type": "json_schema",
              "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True}}  # fmt: skip
        return _ask(client, case["prompt"], max_tokens=512, response_format=rf).choices[0]

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(one, cases))
    length = 0
    for case, a in zip(cases, answers, strict=True):
        if a.finish_reason == "length":
            length += 1
            continue
        assert a.finish_reason == "stop"
        jsonschema.validate(json.loads(a.message.content), case["schema"])
    assert length / len(cases) <= 0.05, f"{length} of {len(cases)} ended with 'length'"
    st = eng.stats()["structured"]
    assert st["steps"] > 0 and st["compiled"] >= len(cases)


def test_sdk_parse_with_pydantic(served):
    client, _ = served

    class City(pydantic.BaseModel):
        name: str
        country: str
        population: int

    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Give facts about Paris as JSON."}],
        response_format=City,
        max_tokens=200,
        temperature=0,
    )
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, City) and msg.parsed.name


def test_regex_and_choice_streamed_and_not(served):
    client, _ = served
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    r = _ask(client, "When did the first moon landing happen? Give the date.", max_tokens=30,
             extra_body={"guided_regex": date})  # fmt: skip
    assert re.fullmatch(date, r.choices[0].message.content)
    choices = ["Paris", "London", "Berlin"]
    kw = dict(max_tokens=10, extra_body={"structured_outputs": {"choice": choices}})
    r = _ask(client, "What is the capital of France?", **kw)
    answer = r.choices[0].message.content
    assert answer in choices and r.choices[0].finish_reason == "stop"
    chunks = list(_ask(client, "What is the capital of France?", stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == answer  # greedy: streamed as answered
    c = client.completions.create(model=MODEL, prompt="The answer is", max_tokens=10,
                                  temperature=0, extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
    assert c.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format.json_schema.schema"),
        ({"grammar": "root ::= missing"}, "grammar"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ],
)  # fmt: skip
def test_bad_constraints_are_400s_naming_the_field(served, extra, param):
    client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, "hi", max_tokens=4, extra_body=extra)
    assert e.value.status_code == 400 and e.value.param == param
