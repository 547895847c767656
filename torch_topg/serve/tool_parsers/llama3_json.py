"""Llama 3.x JSON tool calling: the whole answer is a call object, ``{"name": ...,
"parameters": {...}}`` (``arguments`` accepted too), after an optional
``<|python_tag|>``; several calls are separated by ``;``. An answer that does not start
with ``{`` (or the tag) is content, as is text after the calls. ``<|python_tag|>`` is a
special token: the detokeniser keeps it only when asked (``needs_special_tokens``);
without it the JSON alone still parses."""

from __future__ import annotations

from torch_topg.serve.tool_parsers.base import Piece, ToolParser
from torch_topg.serve.tool_parsers.json_scan import scan_calls, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """``{"name": ..., "parameters": ...}`` answers (Llama 3.1 / 3.2 / 3.3)."""

    name = "llama3_json"
    markers = (PYTHON_TAG,)
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> list[Piece]:
        n = len(text)
        i = skip_ws(text, 0)
        if i == n:
            return [text] if final and text else []
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return []  # may be the tag
        elif text[i] != "{":
            return [text]
        pieces: list[Piece] = []
        while i < n:
            got = scan_calls(text, i, final) if text[i] == "{" else None
            if got is None:
                if not pieces:
                    return [text]
                pieces.append(text[i:])
                return pieces
            calls, j, done = got
            pieces.extend(calls)
            if not done:
                return pieces
            j = skip_ws(text, j)
            if j < n and text[j] == ";" and not calls[-1].error:
                i = skip_ws(text, j + 1)
                continue
            if j < n:
                pieces.append(text[j:])
            return pieces
        if final and not pieces:
            return [text]  # a lone tag: content
        return pieces
