"""Reasoning split out of the answer, for models that think inside ``<think>`` tags
(``--reasoning-parser``): the text inside goes to ``reasoning_content``, the rest to
``content`` (and on to the tool-call parser).

Two behaviours, as the families write them:

- ``qwen3``: reasoning only when the answer opens with ``<think>`` (or the rendered
  prompt already ends with it, as templates that force thinking do); otherwise the
  whole answer is content.
- ``deepseek_r1``: the answer starts inside the reasoning (the template opened the tag),
  an optional leading ``<think>`` skipped, until ``</think>``; an answer that never
  closes it is all reasoning.

Whitespace at the start of the reasoning and of the content after ``</think>`` is
dropped. Streaming holds back a tail that could still be a tag, so a stream split
anywhere reassembles to the whole-text split.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_topg.serve.tool_parsers.base import hold_marker_prefix
from torch_topg.serve.tool_parsers.json_scan import WS

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    """``implicit``: reasoning from the first token (DeepSeek-R1's behaviour)."""

    name: str
    implicit: bool = False

    def stream(self, prompt: str | None = None) -> ReasoningStream:
        """A streaming split; ``prompt``: the rendered prompt (one ending in ``<think>``
        starts inside the reasoning)."""
        opened = self.implicit or (prompt is not None and prompt.rstrip(WS).endswith(START))
        return ReasoningStream(opened)

    def split(self, text: str, prompt: str | None = None) -> tuple[str | None, str]:
        """``(reasoning or None, content)`` of a whole output."""
        s = self.stream(prompt)
        s.feed(text)
        s.finish()
        return (s.reasoning if s.thinking else None), s.content


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3"),
    "think": ReasoningParser("think"),  # the same rule under a neutral name
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit=True),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known: {known}")
    return REASONING_PARSERS[name]


def _split(text: str, opened: bool, final: bool) -> tuple[bool, str, str]:
    """(thinking, reasoning, content) of ``text`` so far."""
    i = skip = 0
    n = len(text)
    while skip < n and text[skip] in WS:
        skip += 1
    if text.startswith(START, skip):
        opened, i = True, skip + len(START)
    elif not final and START.startswith(text[skip:]):
        return opened, "", ""  # may still be the tag
    if not opened:
        return False, "", text
    k = text.find(END, i)
    if k < 0:
        end = n if final else hold_marker_prefix(text, n, (END,))
        return True, text[i:end].lstrip(WS), ""
    return True, text[i:k].lstrip(WS), text[k + len(END) :].lstrip(WS)


class ReasoningStream:
    """:meth:`feed` text deltas, :meth:`finish` at the end: each returns
    ``(reasoning delta, content delta)``."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.text = ""
        self.reasoning = ""
        self.content = ""
        self.thinking = opened

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._update(False)

    def finish(self) -> tuple[str, str]:
        return self._update(True)

    def _update(self, final: bool) -> tuple[str, str]:
        thinking, reasoning, content = _split(self.text, self.opened, final)
        self.thinking = self.thinking or thinking
        r = reasoning[len(self.reasoning) :]
        c = content[len(self.content) :]
        self.reasoning, self.content = reasoning, content
        return r, c
