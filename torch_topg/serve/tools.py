"""Tool calling on the chat endpoint: ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
checked, the JSON schema a forced call must follow, and one choice's output split into
reasoning, content and tool calls (whole, or as streamed deltas).

``tool_choice``: ``"auto"`` (the default with tools) renders the tools and parses the
answer; ``"none"`` renders no tools and parses nothing (the answer is content, markup
and all); ``"required"`` and a named function must be enforced by a grammar so the call
always parses: :func:`tool_call_schema` gives the schema and :func:`constrain_to_tool_call`
is where it meets the sampler (not in this build: a 400 says so).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch_topg.serve.errors import APIError
from torch_topg.serve.reasoning import ReasoningParser
from torch_topg.serve.tool_parsers import CallDelta, Parsed, ToolCall, ToolParser
from torch_topg.serve.tool_parsers.base import Piece
from torch_topg.serve.tool_parsers.json_scan import scan_calls, skip_ws

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_FUNCTION_KEYS = ("name", "description", "parameters", "strict")
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools, checked. ``choice``: none / auto / required / function (then
    ``function`` names it). ``tools``: as sent, for the chat template."""

    tools: list[dict[str, Any]]
    choice: str = "auto"
    function: str | None = None
    parallel: bool = True

    @property
    def rendered(self) -> bool:
        """Whether the tools go into the prompt (all but ``"none"``)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1


def parse_tools(fields: dict[str, Any]) -> ToolSpec | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body (non-null
    fields); None without tools (and ``tool_choice`` absent or ``"none"``). 400s name the
    field: ``tools[i].function.name``, ``tool_choice``, ..."""
    tools = fields.get("tools")
    choice = fields.get("tool_choice")
    parallel = fields.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise APIError(f"parallel_tool_calls must be a bool, got {parallel!r:.40}",
                       param="parallel_tool_calls")  # fmt: skip
    if tools is None:
        if choice not in (None, "none"):
            raise APIError(
                "tool_choice needs tools: the request declares none", param="tool_choice"
            )
        return None
    if not isinstance(tools, list) or not tools:
        raise APIError("tools must be a non-empty list of functions", param="tools")
    names = [_check_tool(t, i) for i, t in enumerate(tools)]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise APIError(f"tools[{i}].function.name: {name!r} is declared twice",
                           param=f"tools[{i}].function.name")  # fmt: skip
    kind, function = _check_choice(choice if choice is not None else "auto", names)
    return ToolSpec(tools, kind, function, parallel)


def _check_tool(tool: Any, i: int) -> str:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise APIError(f"{where} must be an object", param=where)
    for key in tool:
        if key not in ("type", "function"):
            raise APIError(f"{where}.{key} is not a field of a tool (type, function)",
                           param=f"{where}.{key}")  # fmt: skip
    if tool.get("type") != "function":
        raise APIError(f"{where}.type must be 'function', got {tool.get('type')!r:.40}",
                       param=f"{where}.type")  # fmt: skip
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise APIError(f"{where}.function must be an object", param=f"{where}.function")
    for key in fn:
        if key not in _FUNCTION_KEYS:
            raise APIError(f"{where}.function.{key} is not a field of a function "
                           f"({', '.join(_FUNCTION_KEYS)})", param=f"{where}.function.{key}")  # fmt: skip
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise APIError(
            f"{where}.function.name is required: 1-64 letters, digits, underscores or "
            f"dashes, got {name!r:.80}",
            param=f"{where}.function.name",
        )
    for key, kind in (("description", str), ("parameters", dict), ("strict", bool)):
        v = fn.get(key)
        if v is not None and not isinstance(v, kind):
            raise APIError(f"{where}.function.{key} must be a {'JSON schema object' if kind is dict else kind.__name__}",
                           param=f"{where}.function.{key}")  # fmt: skip
    return name


def _check_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise APIError(f"tool_choice must be one of {', '.join(CHOICES)} or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.40}",
                           param="tool_choice")  # fmt: skip
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise APIError("tool_choice must be a string or {'type': 'function', 'function': "
                       "{'name': ...}}", param="tool_choice")  # fmt: skip
    if name not in names:
        raise APIError(f"tool_choice names {name!r}, which is not in tools "
                       f"({', '.join(names)})", param="tool_choice")  # fmt: skip
    return "function", name


# --- required / named: the schema a forced call follows ----------------------------------
def tool_call_schema(
    tools: list[dict[str, Any]], tool_choice: Any, parallel: bool = True
) -> dict[str, Any]:
    """The JSON schema of the output that ``tool_choice`` (``"required"`` or
    ``{"type": "function", "function": {"name": ...}}``) forces.

    The output is a neutral JSON form, not a model's markup: an array of at least one
    ``{"name": <a declared function>, "arguments": <its parameters>}`` (only the named
    function for a named choice; at most one item unless ``parallel``). The chat
    template still renders the tools; :class:`ForcedToolParser` reads the output."""
    if isinstance(tool_choice, dict):
        wanted = {tool_choice["function"]["name"]}
    elif tool_choice == "required":
        wanted = None
    else:
        raise ValueError(f"tool_call_schema: no call is forced by tool_choice={tool_choice!r}")
    options = []
    for t in tools:
        fn = t["function"]
        if wanted is not None and fn["name"] not in wanted:
            continue
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        options.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })  # fmt: skip
    if not options:
        raise ValueError(f"tool_call_schema: {sorted(wanted or ())} not among the tools")
    items = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def constrain_to_tool_call(sampling: dict[str, Any], schema: dict[str, Any]) -> None:
    """Constrain the request's sampling to ``schema`` (``tool_choice`` ``"required"`` or a
    named function): ``SamplingParams.structured`` becomes ``Structured("json_schema",
    schema)``, so the answer is always a call that parses. A request that also carries a
    structured-output constraint is refused (400 naming ``tool_choice``): one grammar per
    answer."""
    from torch_topg.engine.structured import Structured

    if sampling.get("structured") is not None:
        raise APIError(
            "tool_choice 'required' or a named function forces the answer's grammar; it "
            "cannot be combined with response_format or another structured-output field",
            param="tool_choice",
        )
    sampling["structured"] = Structured("json_schema", schema)


class ForcedToolParser(ToolParser):
    """The output :func:`tool_call_schema` forces: a JSON array of ``{"name",
    "arguments"}`` (an object alone is read as one call)."""

    name = "forced_json"

    def scan(self, text: str, final: bool) -> list[Piece]:
        got = scan_calls(text, skip_ws(text, 0), final)
        if got is None:
            return [text] if final else []
        calls, end, _ = got
        rest = text[end:] if final else ""
        return [*calls, rest] if rest.strip() else list(calls)


# --- one choice's output ---------------------------------------------------------------
Event = tuple[str, str] | CallDelta  # ("reasoning" | "content", text) or a call delta


class OutputParser:
    """One choice's output split into reasoning, content and calls, fed text deltas.

    ``tools``: the tool-call parser (None: no tool parsing), ``reasoning``: the
    reasoning parser (None: none); ``prompt``: the rendered prompt (a reasoning parser
    checks whether it opened the reasoning)."""

    def __init__(
        self,
        tools: ToolParser | None,
        reasoning: ReasoningParser | None,
        prompt: str | None = None,
        max_calls: int | None = None,
    ) -> None:
        self._reasoning = reasoning.stream(prompt) if reasoning is not None else None
        self._tools = tools.stream(max_calls) if tools is not None else None
        self.reasoning = ""

    def feed(self, text: str) -> list[Event]:
        return self._step(text, final=False)

    def finish(self) -> list[Event]:
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> list[Event]:
        events: list[Event] = []
        content = text
        if self._reasoning is not None:
            r, content = self._reasoning.finish() if final else self._reasoning.feed(text)
            if r:
                self.reasoning += r
                events.append(("reasoning", r))
        if self._tools is None:
            if content:
                events.append(("content", content))
            return events
        out = self._tools.feed(content) if content else []
        if final:
            out += self._tools.finish()
        events += [("content", e) if isinstance(e, str) else e for e in out]
        return events

    def result(self) -> tuple[str | None, Parsed]:
        """``(reasoning or None, content and calls)`` after :meth:`finish`."""
        reasoning = (
            self.reasoning if self._reasoning is not None and self._reasoning.thinking else None
        )
        if self._tools is not None:
            return reasoning, self._tools.result()
        content = self._reasoning.content if self._reasoning is not None else ""
        return reasoning, Parsed(content, [])


def message(text_parsed: tuple[str | None, Parsed], with_reasoning: bool) -> dict[str, Any]:
    """The ``message`` of a non-streamed chat choice."""
    reasoning, parsed = text_parsed
    msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if with_reasoning:
        msg["reasoning_content"] = reasoning
    if parsed.calls:
        msg["tool_calls"] = [c.to_openai() for c in parsed.calls]
    return msg


@dataclass(frozen=True)
class OutputSpec:
    """How a chat request's choices are read: its tool parser (None: no tool parsing),
    the server's reasoning parser (None: none), the rendered prompt and the call limit."""

    tools: ToolParser | None
    reasoning: ReasoningParser | None
    prompt: str | None = None
    max_calls: int | None = None

    def parser(self) -> OutputParser:
        """A fresh parser for one choice."""
        return OutputParser(self.tools, self.reasoning, self.prompt, self.max_calls)

    def message(self, text: str) -> dict[str, Any]:
        """The ``message`` of a whole choice's text."""
        p = self.parser()
        p.feed(text)
        p.finish()
        return message(p.result(), self.reasoning is not None)


def event_delta(event: Event) -> dict[str, Any]:
    """A parser event as a chunk's ``delta``."""
    if isinstance(event, CallDelta):
        return {"tool_calls": [event.to_openai()]}
    kind, text = event
    return {"reasoning_content" if kind == "reasoning" else "content": text}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's ``"tool_calls"`` for a choice that stopped after making calls."""
    return "tool_calls" if called and reason == "stop" else reason


__all__ = [
    "ForcedToolParser", "OutputParser", "OutputSpec", "ToolCall", "ToolSpec",
    "constrain_to_tool_call", "event_delta", "finish_reason", "message", "parse_tools",
    "tool_call_schema",
]  # fmt: skip
