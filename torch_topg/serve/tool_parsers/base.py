"""What every tool-call parser shares: the parsed result, the streamed events, and one
driver that turns a format's scan of the text so far into OpenAI-style deltas.

A format (``hermes.py``, ``llama3_json.py``, ``mistral.py``) only implements
:meth:`ToolParser.scan`: the output read from the start into pieces, content text and
calls (:class:`~torch_topg.serve.tool_parsers.json_scan.CallScan`), holding back a tail
that could still become markup. :class:`ToolStream` rescans after every chunk and emits
what grew: content, a call's name (once, with its id) and its arguments' new text. The
whole-text parse is the same stream fed everything at once, so a stream split anywhere
reassembles to it (the tests split at every character and every token).

Whitespace next to a call (between calls, around the markup) is not content; a message
that is only calls has ``content`` None, as OpenAI's.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from torch_topg.serve.tool_parsers.json_scan import WS, CallScan

# A piece of the scanned output: content text, or a call (possibly incomplete).
Piece = str | CallScan


def new_call_id() -> str:
    """OpenAI-style tool-call id: ``call_`` and 24 random hex digits."""
    return f"call_{secrets.token_hex(12)}"


@dataclass
class ToolCall:
    """A parsed call: ``arguments`` is JSON text, as OpenAI's ``function.arguments``."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    """A whole output: ``content`` (None when empty beside calls) and its calls."""

    content: str | None
    calls: list[ToolCall]


@dataclass
class CallDelta:
    """A streamed piece of call ``index``: the first carries ``id`` and ``name`` (and
    arguments ""), the next ones only ``arguments`` text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        if self.name is not None:
            return {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


def hold_marker_prefix(text: str, end: int, markers: tuple[str, ...]) -> int:
    """``end`` moved back over a tail of ``text[:end]`` that is a proper prefix of one of
    ``markers`` (it may become that marker once more text arrives)."""
    best = end
    for m in markers:
        for k in range(min(len(m) - 1, end), 0, -1):
            if text.endswith(m[:k], 0, end):
                best = min(best, end - k)
                break
    return best


class ToolParser(ABC):
    """One output format. ``name``: the registry's key. ``markers``: the literal strings
    that start calls (used to detect the format in a chat template too).
    ``needs_special_tokens``: its markers are special tokens, which the detokeniser
    drops unless asked to keep them."""

    name: str = ""
    markers: tuple[str, ...] = ()
    needs_special_tokens: bool = False

    @abstractmethod
    def scan(self, text: str, final: bool) -> list[Piece]:
        """``text`` (all output so far) as content and calls. Not ``final``: content
        that may still turn into markup is left out (held), and the last call may be
        incomplete. The pieces of a longer text extend those of a shorter one."""

    def stream(self, max_calls: int | None = None) -> ToolStream:
        """A streaming parse; ``max_calls``: calls past that many are dropped."""
        return ToolStream(self, max_calls)

    def parse(self, text: str, max_calls: int | None = None) -> Parsed:
        """The whole output at once (the same result a stream of it reassembles to)."""
        s = self.stream(max_calls)
        s.feed(text)
        s.finish()
        return s.result()


def assemble(pieces: list[Piece], final: bool) -> tuple[str, list[CallScan]]:
    """Content and calls of ``pieces``: whitespace next to a call dropped; while not
    ``final`` a trailing whitespace run is held (a call may follow it)."""
    content: list[str] = []
    calls: list[CallScan] = []
    for k, p in enumerate(pieces):
        if isinstance(p, CallScan):
            calls.append(p)
            continue
        text = p
        if k > 0 and isinstance(pieces[k - 1], CallScan):
            text = text.lstrip(WS)
        last = k == len(pieces) - 1
        if (not last and isinstance(pieces[k + 1], CallScan)) or (last and not final):
            text = text.rstrip(WS)
        content.append(text)
    return "".join(content), calls


Event = str | CallDelta  # a content delta, or a call delta


class ToolStream:
    """Incremental parse of one output: :meth:`feed` each text delta, :meth:`finish` at
    the end; each returns the new events (content strings and :class:`CallDelta`)."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self.finished = False

    def feed(self, delta: str) -> list[Event]:
        if self.finished:
            raise RuntimeError("ToolStream.feed after finish()")
        if not delta:
            return []
        self.text += delta
        return self._update(final=False)

    def finish(self) -> list[Event]:
        if self.finished:
            return []
        self.finished = True
        return self._update(final=True)

    def _update(self, final: bool) -> list[Event]:
        content, calls = assemble(self.parser.scan(self.text, final), final)
        events: list[Event] = []
        if not content.startswith(self.content):  # a format broke its contract: a bug
            raise AssertionError(f"{self.parser.name}: content {content!r} does not extend "
                                 f"{self.content!r}")  # fmt: skip
        if len(content) > len(self.content):
            events.append(content[len(self.content) :])
            self.content = content
        if self.max_calls is not None:
            calls = calls[: self.max_calls]
        for k, cs in enumerate(calls):
            if cs.name is None:
                break  # a call's name comes before anything of the calls after it
            if k == len(self.calls):
                call = ToolCall(cs.name, "")
                self.calls.append(call)
                events.append(CallDelta(k, "", id=call.id, name=call.name))
            call = self.calls[k]
            if cs.arguments.startswith(call.arguments) and len(cs.arguments) > len(call.arguments):
                events.append(CallDelta(k, cs.arguments[len(call.arguments) :]))
                call.arguments = cs.arguments
        return events

    def result(self) -> Parsed:
        """What has been emitted so far (after :meth:`finish`: the whole parse)."""
        content = self.content if (self.content or not self.calls) else None
        return Parsed(content, list(self.calls))
