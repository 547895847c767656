"""Mistral's calls: content, then ``[TOOL_CALLS]`` and a JSON array of call objects
(``[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]``, the v3 tokenizers' format), or
per call ``[TOOL_CALLS]name[ARGS]{...}`` (the v11+ format). ``[TOOL_CALLS]`` and
``[ARGS]`` are special tokens: the detokeniser keeps them only when asked
(``needs_special_tokens``). Text after the calls is content."""

from __future__ import annotations

import re

from torch_topg.serve.tool_parsers.base import Piece, ToolParser, hold_marker_prefix
from torch_topg.serve.tool_parsers.json_scan import CallScan, scan_calls, skip_ws, value_end

MARK, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


def _named_call(text: str, i: int, final: bool) -> tuple[CallScan | None, int, bool]:
    """``name[ARGS]{...}`` at ``i``: (call, end, done); call None: not a call (done) or
    not known yet (not done)."""
    m = _NAME.match(text, i)
    j = m.end() if m else i
    if j == len(text) or (not final and ARGS.startswith(text[j:])):
        return None, j, final
    if not m or not text.startswith(ARGS, j):
        return None, j, True
    a = skip_ws(text, j + len(ARGS))
    end = value_end(text, a, final)
    if end is None:
        return CallScan(m.group(), text[a:].rstrip(), end=len(text)), len(text), final
    if end == -1:
        return CallScan(m.group(), "{}", True, True, a), a, True
    return CallScan(m.group(), text[a:end], True, end=end), end, True


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS][{...}]`` or ``[TOOL_CALLS]name[ARGS]{...}`` (Mistral, Mixtral)."""

    name = "mistral"
    markers = (MARK,)
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> list[Piece]:
        pieces: list[Piece] = []
        i = 0
        while True:
            k = text.find(MARK, i)
            if k < 0:
                end = len(text) if final else hold_marker_prefix(text, len(text), (MARK,))
                if end > i:
                    pieces.append(text[i:end])
                return pieces
            if k > i:
                pieces.append(text[i:k])
            body = skip_ws(text, k + len(MARK))
            if body < len(text) and text[body] in "[{":
                got = scan_calls(text, body, final)
                if got is not None:
                    calls, j, done = got
                    pieces.extend(calls)
                    if not done:
                        return pieces
                    i = j
                    continue
            elif body < len(text):
                call, j, done = _named_call(text, body, final)
                if call is not None:
                    pieces.append(call)
                if not done:
                    return pieces
                if call is not None:
                    i = j
                    continue
            elif not final:
                return pieces
            pieces.append(MARK)  # not a call: the marker is content
            i = k + len(MARK)
