"""Tool-call and reasoning parsers on recorded-style model outputs: the whole-text parse
gives the expected content and calls, and the same output streamed (split at every
character, and at every token of SmolLM2's tokenizer) reassembles to it; the forced-call
schema validates good calls and rejects bad ones; the shipped templates render tools."""

from __future__ import annotations

import json

import pytest

from torch_topg.serve.chat_template import ChatInput, ChatRenderer, renders_tools, shipped_template
from torch_topg.serve.errors import APIError
from torch_topg.serve.protocol import chat_messages
from torch_topg.serve.reasoning import get_reasoning_parser
from torch_topg.serve.tool_parsers import CallDelta, detect_tool_parser, get_tool_parser
from torch_topg.serve.tools import (
    ForcedToolParser,
    OutputParser,
    constrain_to_tool_call,
    parse_tools,
    tool_call_schema,
)

W = '{"city": "Paris", "unit": "celsius"}'
# (parser, output as the model wrote it, expected content, expected [(name, arguments)])
SAMPLES = [
    # Qwen2.5 / Hermes 3: content, then one block
    (
        "hermes",
        f'I will check the weather.\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
        "I will check the weather.",
        [("get_weather", W)],
    ),
    # Qwen3 parallel calls, nested arguments with brackets and escapes inside strings
    (
        "hermes",
        '<tool_call>\n{"name": "search", "arguments": {"q": "a [b] {c} \\"d\\"", "k": [1, 2, {"x": null}]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        None,
        [("search", '{"q": "a [b] {c} \\"d\\"", "k": [1, 2, {"x": null}]}'), ("now", "{}")],
    ),
    # SmolLM2's trained format: a JSON list inside one block
    (
        "hermes",
        '<tool_call>[\n{"name": "get_weather", "arguments": {"city": "Paris"}},\n{"name": "get_time", "arguments": {"tz": "CET"}}\n]</tool_call>',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')],
    ),
    ("hermes", "<tool_call>[]</tool_call>", "", []),  # SmolLM2: no call needed
    (
        "hermes",
        "Paris is the capital of France. Its weather is mild.",
        "Paris is the capital of France. Its weather is mild.",
        [],
    ),
    ("hermes", "Use a <tool_call> tag like <this>.", "Use a <tool_call> tag like <this>.", []),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"n": 3}, "name": "roll"}\n</tool_call>',
        None,
        [("roll", '{"n": 3}')],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "encoded", "arguments": "{\\"a\\": 1}"}\n</tool_call>',
        None,
        [("encoded", '{"a": 1}')],
    ),
    ("hermes", '<tool_call>\n{"name": "no_args"}\n</tool_call>', None, [("no_args", "{}")]),
    (
        "hermes",
        '<tool_call>\n{"name": "cut", "arguments": {"text": "unfinish',
        None,
        [("cut", '{"text": "unfinish')],
    ),
    (
        "hermes",
        'Unicode: é ü 北京 <tool_call>{"name": "geo", "arguments": {"city": "北京"}}</tool_call> done',
        "Unicode: é ü 北京done",
        [("geo", '{"city": "北京"}')],
    ),
    # Llama 3.1 / 3.2 JSON
    ("llama3_json", f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", W)]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [true, false]}}',
        None,
        [("a", '{"x": 1}'), ("b", '{"y": [true, false]}')],
    ),
    ("llama3_json", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("llama3_json", "{not a call} at all", "{not a call} at all", []),
    # Mistral v3 (array) and v11 (name[ARGS]) forms
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}, "id": "a1b2c3d4e"}}]',
        None,
        [("get_weather", W)],
    ),
    (
        "mistral",
        'Checking both. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "Checking both.",
        [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")],
    ),
    ("mistral", "No call: [TOOL] is not the marker.", "No call: [TOOL] is not the marker.", []),
]


def _reassemble(events) -> tuple[str, list[tuple[str, str]], list[CallDelta]]:
    content, calls, deltas = "", {}, []
    for e in events:
        if isinstance(e, str):
            content += e
            continue
        deltas.append(e)
        if e.name is not None:
            assert e.index not in calls and e.index == len(calls)  # names come first, in order
            assert e.id.startswith("call_") and e.arguments == ""
            calls[e.index] = [e.name, ""]
        else:
            calls[e.index][1] += e.arguments
    return content, [tuple(calls[k]) for k in sorted(calls)], deltas


def _stream(parser, pieces, max_calls=None):
    s = parser.stream(max_calls)
    events = []
    for p in pieces:
        events += s.feed(p)
    events += s.finish()
    return _reassemble(events)


@pytest.mark.parametrize(("name", "text", "content", "calls"), SAMPLES)
def test_whole_parse(name, text, content, calls) -> None:
    parsed = get_tool_parser(name).parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    for c in parsed.calls:
        if not c.arguments.endswith("unfinish"):
            json.loads(c.arguments)


@pytest.mark.parametrize(("name", "text", "content", "calls"), SAMPLES)
def test_streamed_at_every_character_and_cut(name, text, content, calls) -> None:
    parser = get_tool_parser(name)
    assert _stream(parser, list(text))[:2] == (content or "", calls)
    for cut in range(len(text) + 1):  # every two-piece split
        assert _stream(parser, [text[:cut], text[cut:]])[:2] == (content or "", calls), cut


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from torch_topg.models import smollm2_available

    if smollm2_available() is not None:
        pytest.skip(str(smollm2_available()))
    from transformers import AutoTokenizer

    from torch_topg.models.hf import smollm2_folder

    return AutoTokenizer.from_pretrained(smollm2_folder())


@pytest.mark.parametrize(("name", "text", "content", "calls"), SAMPLES)
def test_streamed_at_every_token(smollm2_tokenizer, name, text, content, calls) -> None:
    """The deltas a stream delivers: the text of each token of SmolLM2's tokenizer, held
    while a token ends inside a character (as the engine's detokeniser does)."""
    tok = smollm2_tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    pieces, done = [], ""
    for k in range(1, len(ids) + 1):
        now = tok.decode(ids[:k])
        if now.endswith("\ufffd"):
            continue
        pieces.append(now[len(done) :])
        done = now
    assert "".join(pieces) == text
    assert _stream(get_tool_parser(name), pieces)[:2] == (content or "", calls)


def test_parallel_tool_calls_false_keeps_the_first() -> None:
    text = SAMPLES[1][1]
    parsed = get_tool_parser("hermes").parse(text, max_calls=1)
    assert [c.name for c in parsed.calls] == ["search"]
    assert _stream(get_tool_parser("hermes"), list(text), max_calls=1)[1] == [
        (c.name, c.arguments) for c in parsed.calls
    ]


def test_arguments_stream_in_fragments_before_the_call_ends() -> None:
    text = SAMPLES[0][1]
    s = get_tool_parser("hermes").stream()
    cut = text.index('"Paris"') + 3
    events = s.feed(text[:cut])
    names = [e for e in events if isinstance(e, CallDelta) and e.name]
    frags = [e.arguments for e in events if isinstance(e, CallDelta) and e.name is None]
    assert names and names[0].name == "get_weather" and "".join(frags) == '{"city": "Pa'
    assert not any(isinstance(e, str) and "<tool" in e for e in events)  # no markup leaks


REASONING = [
    (
        "qwen3",
        None,
        "<think>\nThe user wants 2+2.\n</think>\n\n2 + 2 = 4.",
        "The user wants 2+2.\n",
        "2 + 2 = 4.",
    ),
    ("qwen3", None, "2 + 2 = 4.", None, "2 + 2 = 4."),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Simple sum.</think>4", "Simple sum.", "4"),
    (
        "deepseek_r1",
        None,
        "Let me add.\n</think>\n\nThe answer is 4.",
        "Let me add.\n",
        "The answer is 4.",
    ),
    ("deepseek_r1", None, "<think>Still thinking", "Still thinking", ""),
]


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), REASONING)
def test_reasoning_split_whole_and_streamed(name, prompt, text, reasoning, content) -> None:
    parser = get_reasoning_parser(name)
    assert parser.split(text, prompt) == (reasoning, content)
    for pieces in (list(text), *([text[:k], text[k:]] for k in range(len(text) + 1))):
        s, r, c = parser.stream(prompt), "", ""
        for p in pieces:
            dr, dc = s.feed(p)
            r, c = r + dr, c + dc
        dr, dc = s.finish()
        assert (r + dr, c + dc) == (reasoning or "", content)


def test_reasoning_then_tool_call() -> None:
    """Reasoning first; a call inside the reasoning is not a call; the one after is."""
    text = ('<think>\nMaybe <tool_call>{"name": "x", "arguments": {}}</tool_call>? No.\n</think>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')  # fmt: skip
    tools, reasoning = get_tool_parser("hermes"), get_reasoning_parser("qwen3")
    for pieces in (list(text), [text]):
        p = OutputParser(tools, reasoning)
        for piece in pieces:
            p.feed(piece)
        p.finish()
        r, parsed = p.result()
        assert r.startswith("Maybe <tool_call>") and parsed.content is None
        assert [(c.name, c.arguments) for c in parsed.calls] == [
            ("get_weather", '{"city": "Paris"}')
        ]


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"],
                    "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip


def test_tool_call_schema_validates_calls() -> None:
    import jsonschema

    required = tool_call_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(required)
    good = [
        [{"name": "get_weather", "arguments": {"city": "Paris"}}],
        [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}},
         {"name": "get_time", "arguments": {}}],
    ]  # fmt: skip
    bad = [
        [],  # no call
        [{"name": "get_weather", "arguments": {}}],  # a required argument missing
        [{"name": "get_weather", "arguments": {"city": "Paris", "wind": 3}}],  # extra key
        [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}],
        [{"name": "launch", "arguments": {}}],  # not a declared function
        [{"name": "get_time"}],  # no arguments
        {"name": "get_time", "arguments": {}},  # not a list
    ]
    for call in good:
        jsonschema.validate(call, required)
    for call in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, required)
    named = tool_call_schema(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    jsonschema.validate([{"name": "get_time", "arguments": {}}], named)
    for call in (good[0], [{"name": "get_time", "arguments": {}}] * 2):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(call, named)
    # what the schema forces, the forced reader parses (whole and streamed)
    text = json.dumps(good[1])
    parsed = ForcedToolParser().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        (c["name"], c["arguments"]) for c in good[1]
    ]
    assert _stream(ForcedToolParser(), list(text))[1] == [
        (c.name, c.arguments) for c in parsed.calls
    ]


def test_forcing_a_call_sets_the_grammar_and_refuses_a_second_one() -> None:
    from torch_topg.engine.structured import Structured

    sampling: dict = {}
    schema = tool_call_schema(TOOLS, "required")
    constrain_to_tool_call(sampling, schema)
    assert sampling["structured"] == Structured("json_schema", schema)
    with pytest.raises(APIError, match="cannot be combined") as e:
        constrain_to_tool_call(sampling, schema)
    assert e.value.status == 400 and e.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": []}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"parameters": {}}}]},
            "tools[0].function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tools_name_the_field(fields, param) -> None:
    with pytest.raises(APIError) as e:
        parse_tools(fields)
    assert e.value.status == 400 and e.value.param == param


def test_templates_and_parser_detection(smollm2_tokenizer) -> None:
    tok = smollm2_tokenizer
    assert not renders_tools(tok, None)  # SmolLM2's own template renders no tools
    r = ChatRenderer(tok, model_type="llama")
    assert r.tools_template_name == "smollm2" and r.tool_parser.name == "hermes"
    msgs = chat_messages([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ])  # fmt: skip
    spec = parse_tools({"tools": TOOLS})
    for name, call, result in [
        ("hermes", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "<tool_response>\n18 C"),
        ("smollm2", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', "<tool_response>\n18 C"),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "ipython<|end_header_id|>\n\n18 C"),
        ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_1"}]', '"content": "18 C"'),
    ]:  # fmt: skip
        assert renders_tools(tok, shipped_template(name))
        text = r.render(ChatInput(msgs, spec, name))
        assert '"name": "get_weather"' in text and call in text and result in text, name
        assert detect_tool_parser(shipped_template(name)).name == get_tool_parser(name).name
    # without tools nor tool turns: the model's own template, as the engine renders it
    plain = chat_messages([{"role": "user", "content": "hi"}])
    assert r.render(ChatInput(plain)) == tok.apply_chat_template(
        plain, add_generation_prompt=True, tokenize=False
    )
    with pytest.raises(APIError) as e:  # a template without tools nor a fallback
        ChatRenderer(tok, template="{% for m in messages %}{{ m.content }}{% endfor %}").render(
            ChatInput(plain, spec)
        )
    assert e.value.param == "tools"
