"""Tool calling through the server: the official ``openai`` client on a loopback port
against SmolLM2-135M-Instruct's real weights (``auto`` answers parse, a round trip with a
``role: "tool"`` message, streamed deltas reassemble to the whole answer, bad input is a
400 naming the field), and the chunks of a scripted tool-call answer as OpenAI streams
them (the tiny model cannot be relied on to call a tool: that path is fed recorded text).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install '.[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed")


import openai
from engine_utils import wait_idle
from test_serve_tools import serving

from torch_topg.engine import CompletionOutput, Delta, RequestOutput
from torch_topg.models import smollm2_available
from torch_topg.serve import create_app, generation
from torch_topg.serve.protocol import GenerationRequest
from torch_topg.serve.responses import Response, TokenText
from torch_topg.serve.tool_parsers import get_tool_parser
from torch_topg.serve.tools import OutputSpec

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now? Use the tool."}]
GREEDY = {"temperature": 0, "max_tokens": 48}

needs_smollm2 = pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available()))


@pytest.fixture(scope="module")
def served():
    """``(client, engine, url)`` over SmolLM2 (eager: no compile time in the test)."""
    from torch_topg.engine import Engine

    if smollm2_available() is not None:
        pytest.skip(str(smollm2_available()))
    with Engine.from_pretrained(max_model_len=2048, compile=False, seed=0) as eng:
        with serving(create_app(eng, MODEL)) as url:
            with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as client:
                yield client, eng, url
            wait_idle(eng)
            eng.pool.check_whole()


def _check_message(msg, finish_reason) -> None:
    assert msg.role == "assistant"
    assert "<tool_call>" not in (msg.content or "")  # markup never leaks into content
    if msg.tool_calls:
        assert finish_reason == "tool_calls"
        for c in msg.tool_calls:
            assert c.id.startswith("call_") and c.type == "function"
            assert c.function.name == "get_weather"
    else:
        assert finish_reason in ("stop", "length") and msg.content is not None


def _reassemble(chunks):
    content, calls, reason = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.index not in calls:  # the first delta of a call: id, type and name
                assert t.id.startswith("call_") and t.type == "function" and t.function.name
                calls[t.index] = [t.id, t.function.name, t.function.arguments or ""]
            else:
                assert t.id is None and t.function.name is None
                calls[t.index][2] += t.function.arguments
        reason = ch.choices[0].finish_reason or reason
    return content, [calls[k] for k in sorted(calls)], reason


def test_auto_answer_parses_and_streams_the_same(served) -> None:
    client, _, _ = served
    full = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], **GREEDY)
    choice = full.choices[0]
    _check_message(choice.message, choice.finish_reason)
    print(f"\nSmolLM2 with auto: {len(choice.message.tool_calls or [])} call(s), "
          f"content {choice.message.content!r:.80}")  # fmt: skip
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], stream=True, **GREEDY))  # fmt: skip
    content, calls, reason = _reassemble(chunks)
    assert content == (choice.message.content or "")
    want = [[c.function.name, c.function.arguments] for c in choice.message.tool_calls or []]
    assert [c[1:] for c in calls] == want and reason == choice.finish_reason


def test_round_trip_with_a_tool_result(served) -> None:
    client, _, url = served
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 18, "sky": "sunny"}'},
    ]  # fmt: skip
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=[WEATHER], **GREEDY
    )
    _check_message(answer.choices[0].message, answer.choices[0].finish_reason)
    # /tokenize renders the same prompt the chat endpoint ran
    body = json.dumps({"messages": history, "tools": [WEATHER]}).encode()
    req = urllib.request.Request(url + "/tokenize", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert json.load(r)["count"] == answer.usage.prompt_tokens


def test_tool_choice_none_renders_no_tools(served) -> None:
    client, _, _ = served
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": 0}
    with_tools = client.chat.completions.create(tools=[WEATHER], **kw)
    none = client.chat.completions.create(tools=[WEATHER], tool_choice="none", **kw)
    plain = client.chat.completions.create(**kw)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_call_always_parses_and_names_a_declared_function(served, choice, stream) -> None:
    """tool_choice "required" or a named function: the grammar forces a call, so the
    answer is one that parses, names a declared function (the named one) and has JSON
    arguments; streamed deltas reassemble to it."""
    client, _, _ = served
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 96, "temperature": 0,
          "tools": [WEATHER], "tool_choice": choice}  # fmt: skip
    if stream:
        _, calls, finish = _reassemble(client.chat.completions.create(stream=True, **kw))
        names = [name for _, name, _ in calls]
        args = [a for _, _, a in calls]
    else:
        r = client.chat.completions.create(**kw)
        finish, calls = r.choices[0].finish_reason, r.choices[0].message.tool_calls
        names = [c.function.name for c in calls]
        args = [c.function.arguments for c in calls]
    assert finish == "tool_calls", finish
    assert names and set(names) <= {"get_weather"}
    for a in args:
        assert isinstance(json.loads(a), dict)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools[0].function.name", "required"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice", "not in tools"),
        ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice", "cannot be combined"),
        ({"messages": [*ASK, {"role": "tool", "content": "18 C"}]}, "messages[1].tool_call_id", "required"),
        ({"tools": [WEATHER], "extra_body": {"chat_template_kwargs": {"tools": []}}},
         "chat_template_kwargs.tools", "server"),
        ({"extra_body": {"chat_template": "chatml"}}, "chat_template", "shipped"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s_naming_the_field(served, extra, param, words) -> None:
    client, engine, _ = served
    before = engine.stats()["requests"]["submitted"]
    with pytest.raises(openai.BadRequestError, match=words) as e:
        client.chat.completions.create(
            **{"model": MODEL, "messages": ASK, "max_tokens": 2, **extra}
        )
    assert e.value.status_code == 400 and e.value.param == param
    assert engine.stats()["requests"]["submitted"] == before  # refused before the engine


# --- a scripted answer through the server's streaming and whole paths --------------------
SCRIPT = ['Let', ' me', ' check', '.\n', '<tool', '_call', '>\n{"', 'name', '":', ' "', 'get',
          '_weather', '",', ' "', 'arguments', '":', ' {"', 'city', '":', ' "', 'Par', 'is',
          '"}}', '\n</', 'tool', '_call', '>']  # fmt: skip


class _Scripted:
    """A finished engine request replaying ``SCRIPT`` one delta a token."""

    finished = True

    def __init__(self) -> None:
        text = "".join(SCRIPT)
        self.out = RequestOutput("r0", None, [1, 2, 3], [CompletionOutput(
            0, text, list(range(len(SCRIPT))), "stop", token_times=[0.0] * len(SCRIPT))])  # fmt: skip

    async def __aiter__(self):
        for k, piece in enumerate(SCRIPT):
            last = k == len(SCRIPT) - 1
            yield Delta("r0", 0, piece, [k], None, "stop" if last else None,
                        self.out.usage if last else None)  # fmt: skip

    def result(self, timeout=None):
        return self.out

    def abort(self) -> None:
        pass


class _NoMetrics:
    def observe(self, *a) -> None:
        pass

    def aborted(self, *a) -> None:
        pass


def _request(stream: bool) -> GenerationRequest:
    spec = OutputSpec(get_tool_parser("hermes"), None)
    return GenerationRequest([[1, 2, 3]], {}, stream=stream, output=spec)


async def _collect(agen):
    return [e async for e in agen]


def test_scripted_call_streams_as_openai_does() -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    resp = Response("chat", MODEL)
    events = asyncio.run(_collect(generation.stream(
        resp, _request(True), [_Scripted()], TokenText(None), _NoMetrics(), 0.0)))  # fmt: skip
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [ChatCompletionChunk.model_validate(json.loads(e[6:])) for e in events[:-1]]
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant"
    calls = [d.tool_calls[0] for d in deltas if d.tool_calls]
    first = calls[0]
    assert first.index == 0 and first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    assert len(calls) > 3  # the arguments arrive in fragments, as they are generated
    assert "".join(c.function.arguments for c in calls) == '{"city": "Paris"}'
    assert "".join(d.content or "" for d in deltas) == "Let me check."
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"
    whole = asyncio.run(generation.complete(
        resp, _request(False), [_Scripted()], TokenText(None), _NoMetrics(), _never, 0.0))  # fmt: skip
    msg = ChatCompletion.model_validate(whole).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Let me check."
    (call,) = msg.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')


async def _never() -> bool:
    return False
