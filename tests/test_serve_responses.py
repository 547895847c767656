"""``POST /v1/responses`` (stateless) with the official ``openai`` client's
``client.responses.create``: text answers equal to the chat endpoint's, streamed events
reassembling to the whole response, ``text.format`` through the structured outputs,
function tools on SmolLM2's real weights (forced calls parse, streamed and not), and the
400s of a stateless server."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")
import openai
from engine_utils import wait_idle
from test_serve import chat_engine
from test_serve_tools import serving

from torch_topg.models import smollm2_available
from torch_topg.serve import create_app

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def served():
    with chat_engine() as eng, serving(create_app(eng, MODEL)) as url:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as client:
            yield client, eng


@pytest.fixture(autouse=True)
def whole_pool_after(request):
    yield
    if "served" in request.fixturenames:
        eng = request.getfixturevalue("served")[1]
        wait_idle(eng)
        eng.pool.check_whole()


def test_text_equals_chat(served) -> None:
    client, _ = served
    r = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.",
                                max_output_tokens=8, temperature=0)  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
    )  # fmt: skip
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete"
        assert r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed"


def test_message_list_input(served) -> None:
    client, _ = served
    items = [
        {"role": "developer", "content": "Answer."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=6, temperature=0)
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0,
        messages=[{"role": "system", "content": "Answer."}, {"role": "user", "content": "Hi"}],
    )  # fmt: skip
    assert r.output_text == chat.choices[0].message.content


def test_streamed_events_reassemble(served) -> None:
    client, _ = served
    args = {"model": MODEL, "input": "Hello", "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**args)
    kinds, text, done_text, final = [], "", None, None
    for ev in client.responses.create(stream=True, **args):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text += ev.delta
        elif ev.type == "response.output_text.done":
            done_text = ev.text
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                           "response.incomplete")  # fmt: skip
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert text == done_text == whole.output_text
    assert final is not None and final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_json_object_format(served) -> None:
    client, _ = served
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "required": ["a"], "additionalProperties": False}  # fmt: skip
    r = client.responses.create(
        model=MODEL, input="Give JSON", max_output_tokens=40, temperature=0,
        text={"format": {"type": "json_schema", "name": "x", "schema": schema, "strict": True}},
    )  # fmt: skip
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text)["a"], int)
    else:  # the tiny model may run to the limit; what it wrote still follows the grammar
        assert r.output_text.startswith("{")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "a", "store": True}, "store"),
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": [{"role": "robot", "content": "a"}]}, "input[0].role"),
        ({"input": "a", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "a", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"input": "a", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "a", "reasoning": {"effort": "low"}}, "reasoning"),
        (
            {
                "input": "a",
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}
                },
            },
            "text.format",
        ),
    ],
)
def test_bad_bodies(served, body, param) -> None:
    client, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    assert e.value.body["param"].startswith(param), e.value.body
    if param in ("previous_response_id", "store"):
        assert "stateless" in e.value.body["message"]


# --- function tools on SmolLM2's real weights ---------------------------------------------
WEATHER = {
    "type": "function", "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]},
}  # fmt: skip


@pytest.fixture(scope="module")
def smol():
    from torch_topg.engine import Engine

    if smollm2_available() is not None:
        pytest.skip(str(smollm2_available()))
    with Engine.from_pretrained(max_model_len=2048, compile=False, seed=0) as eng:
        with serving(create_app(eng, "smol")) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                yield client


def test_function_call_forced(smol) -> None:
    args = {"model": "smol", "input": "What is the weather in Paris?", "tools": [WEATHER],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 60, "temperature": 0}  # fmt: skip
    r = smol.responses.create(**args)
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    kinds, streamed_args, done = [], "", None
    for ev in smol.responses.create(stream=True, **args):
        kinds.append(ev.type)
        if ev.type == "response.function_call_arguments.delta":
            streamed_args += ev.delta
        elif ev.type == "response.output_item.done" and ev.item.type == "function_call":
            done = ev.item
    assert done is not None and done.name == "get_weather"
    assert streamed_args == done.arguments == calls[0].arguments
    assert "response.function_call_arguments.done" in kinds
    # the round trip: the call and its output sent back as items
    back = smol.responses.create(
        model="smol", max_output_tokens=20, temperature=0, tools=[WEATHER],
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id,
                "output": "sunny, 21 C"}],
    )  # fmt: skip
    assert back.status in ("completed", "incomplete") and back.output
