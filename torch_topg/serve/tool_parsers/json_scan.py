"""Reading tool calls out of JSON text whose end may not have arrived yet.

A call is an object with a ``name`` string and its arguments under ``arguments`` (or
``parameters``, Llama 3's key). Its arguments are returned as the model's own text of
that value (a slice of the output), so while a stream is still inside the value the
slice seen so far is a prefix of the final one: streamed fragments concatenate to
exactly what a whole-text parse gives. An arguments value that is a JSON string (a
model that encodes the object as a string) is decoded once complete.

The scan is lenient inside values (it tracks strings and bracket nesting, not commas)
and strict where it decides what is a call: a syntax error before the name is known
means the text is not a call; an error after it ends the call where it happened. Both
are decided by the text up to the error, so a stream split anywhere decides the same.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

WS = " \t\r\n"
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_LITERAL = re.compile(r"[A-Za-z0-9.+\-]+")
_PLAIN = re.compile(r'[^"{}\[\]]+')  # inside a container: what needs no attention
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class CallScan:
    """One call as far as the text goes.

    ``name``: None until its string is complete. ``arguments``: the arguments text so far
    (``"{}"`` for a complete call without arguments). ``done``: the object is complete
    (or ended by an error, ``error``). ``end``: index after the object (or where the scan
    stopped)."""

    name: str | None = None
    arguments: str = ""
    done: bool = False
    error: bool = False
    end: int = 0


def skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in WS:
        i += 1
    return i


def value_end(text: str, i: int, final: bool) -> int | None:
    """Index after the JSON value starting at ``text[i]``; None if the text ends inside
    it (a literal at the very end counts as complete only when ``final``); -1 at a
    syntax error (a stray closing bracket, or a literal that is not JSON)."""
    n = len(text)
    if i >= n:
        return None
    c = text[i]
    if c == '"':
        m = _STRING.match(text, i)
        return m.end() if m else None
    if c in "{[":
        stack = [c]
        j = i + 1
        while j < n:
            ch = text[j]
            if ch == '"':
                m = _STRING.match(text, j)
                if not m:
                    return None
                j = m.end()
            elif ch in "{[":
                stack.append(ch)
                j += 1
            elif ch in "}]":
                if stack.pop() != ("{" if ch == "}" else "["):
                    return -1
                j += 1
                if not stack:
                    return j
            else:
                j = _PLAIN.match(text, j).end()  # type: ignore[union-attr]
        return None
    m = _LITERAL.match(text, i)
    if not m:
        return -1
    if m.end() == n and not final:
        return None
    try:
        json.loads(m.group())
    except ValueError:
        return -1
    return m.end()


def scan_call(text: str, i: int, final: bool) -> CallScan | None:
    """The call object whose ``{`` is at ``text[i]``. None: not a call (a syntax error,
    or a name that is not a string, before the name is known; or a complete object
    without a name)."""
    n = len(text)
    cs = CallScan(end=n)
    j = i + 1
    args_start = -1
    while True:
        j = skip_ws(text, j)
        if j >= n:
            break
        c = text[j]
        if c == "}":
            cs.done, cs.end = True, j + 1
            break
        if c == ",":
            j += 1
            continue
        key_match = _STRING.match(text, j) if c == '"' else None
        if key_match is None:
            if c != '"':
                return _error(cs, j)
            break  # the key's string has not ended yet
        key = json.loads(key_match.group())
        j = skip_ws(text, key_match.end())
        if j >= n:
            break
        if text[j] != ":":
            return _error(cs, j)
        j = skip_ws(text, j + 1)
        if j >= n:
            break
        end = value_end(text, j, final)
        if end == -1:
            return _error(cs, j)
        if key in NAME_KEYS and cs.name is None:
            if text[j] != '"':
                return _error(cs, j)
            if end is None:
                break
            cs.name = json.loads(text[j:end])
        elif key in ARGUMENT_KEYS and args_start < 0:
            args_start = j
            if end is None:
                if text[j] != '"':  # a string is decoded once complete
                    cs.arguments = text[j:].rstrip(WS)
                break
            raw = text[j:end]
            cs.arguments = _decoded(raw) if raw.startswith('"') else raw
        elif end is None:
            break
        j = end
    if cs.done and cs.name is None:
        return None
    if cs.done and args_start < 0:
        cs.arguments = "{}"
    return cs


def _decoded(raw: str) -> str:
    value = json.loads(raw)
    return value if isinstance(value, str) else raw


def _error(cs: CallScan, at: int) -> CallScan | None:
    if cs.name is None:
        return None
    cs.done, cs.error, cs.end = True, True, at
    return cs


def scan_calls(text: str, i: int, final: bool) -> tuple[list[CallScan], int, bool] | None:
    """Calls written at ``text[i]``: one object, or an array of objects.

    Returns ``(calls, end, done)``: ``end`` after the object or array (where the scan
    stopped while not ``done``). None: the text there is not a call."""
    if i >= len(text):
        return [], i, False
    if text[i] == "{":
        cs = scan_call(text, i, final)
        if cs is None:
            return None
        return [cs], cs.end, cs.done
    if text[i] != "[":
        return None
    calls: list[CallScan] = []
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return calls, j, False
        c = text[j]
        if c == "]":
            return calls, j + 1, True
        if c == ",":
            j += 1
            continue
        if c != "{":
            return (calls, j, True) if calls else None
        cs = scan_call(text, j, final)
        if cs is None:
            return (calls, j, True) if calls else None
        calls.append(cs)
        if not cs.done:
            return calls, cs.end, False
        if cs.error:
            return calls, cs.end, True
        j = cs.end
