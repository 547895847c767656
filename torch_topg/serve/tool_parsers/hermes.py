"""Hermes-style calls, as Hermes 2/3, Qwen2.5, Qwen3 and SmolLM2 write them: JSON inside
``<tool_call>`` tags, anywhere after (or between) content::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block may also hold a JSON array of calls (SmolLM2's trained format,
``<tool_call>[{"name": ..., "arguments": ...}, ...]</tool_call>``; an empty array is no
call). A block whose body is not a call stays content, markup included. A missing end
tag is tolerated (the call ends with its object)."""

from __future__ import annotations

from torch_topg.serve.tool_parsers.base import Piece, ToolParser, hold_marker_prefix
from torch_topg.serve.tool_parsers.json_scan import scan_calls, skip_ws

START, END = "<tool_call>", "</tool_call>"


def scan_tagged(text: str, final: bool, start: str, end_tag: str) -> list[Piece]:
    """Content and calls of ``start`` ... ``end_tag`` blocks holding JSON calls."""
    pieces: list[Piece] = []
    i = 0
    while True:
        k = text.find(start, i)
        if k < 0:
            end = len(text) if final else hold_marker_prefix(text, len(text), (start,))
            if end > i:
                pieces.append(text[i:end])
            return pieces
        if k > i:
            pieces.append(text[i:k])
        body = skip_ws(text, k + len(start))
        got = scan_calls(text, body, final)
        if got is None or (final and not got[0] and not got[2]):
            pieces.append(start)  # not a call: the marker is content, and so is what follows
            i = k + len(start)
            continue
        calls, j, done = got
        pieces.extend(calls)
        if not done:
            return pieces
        errored = bool(calls) and calls[-1].error
        j = skip_ws(text, j)
        close = text.find(end_tag, j) if errored else (j if text.startswith(end_tag, j) else -1)
        if close >= 0:
            i = close + len(end_tag)
        elif not final and (errored or end_tag.startswith(text[j:])):
            return pieces  # the end tag may still come
        else:
            i = j  # no end tag: the call ends with its JSON


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` (Hermes, Qwen2.5 / Qwen3, SmolLM2)."""

    name = "hermes"
    markers = (START,)

    def scan(self, text: str, final: bool) -> list[Piece]:
        return scan_tagged(text, final, START, END)
