"""Incremental detokenisation and stop strings.

Text is emitted as tokens arrive, never splitting a multi-byte character: a token
sequence whose decoding ends in U+FFFD (an incomplete UTF-8 sequence of a byte-level
BPE) is held until the next token completes it. Each decode covers only a short window
of tokens (from ``prefix_offset``), so a step costs the same at token 10 and token 1000;
the window starts a few prompt tokens back, so tokenizers that drop a leading space
at the start of a decode (SentencePiece) still produce it.

Stop strings: the text is searched for them after every token (only the part that a
new token can have completed). A match ends the sequence with ``finish_reason="stop"``
and the text is cut before it (vLLM's default). While running, the last
``max(len(stop)) - 1`` characters are held back, so a stop string split across tokens
is never half-emitted.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens


class IncrementalDetokenizer:
    """Output text of one sequence, built a token at a time."""

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], stop: list[str] | None = None
    ) -> None:
        self._tok = tokenizer
        ctx = list(prompt_ids[-_CONTEXT_TOKENS:]) if tokenizer is not None else []
        self._ids: list[int] = ctx
        self._prefix = 0
        self._read = len(ctx)
        self.text = ""
        self._emitted = 0
        self.stop = [s for s in (stop or []) if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.stopped = False

    def add(self, token_id: int) -> None:
        """Append one output token (after the stop: ignored)."""
        if self.stopped or self._tok is None:
            return
        self._ids.append(token_id)
        decode = self._tok.decode
        prefix = decode(self._ids[self._prefix : self._read], skip_special_tokens=True)
        full = decode(self._ids[self._prefix :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            before = len(self.text)
            self.text += full[len(prefix) :]
            self._prefix, self._read = self._read, len(self._ids)
            if self.stop:
                self._find_stop(before)
        # else: an incomplete character (or no visible text yet): wait for more tokens

    def _find_stop(self, before: int) -> None:
        start = max(0, before - self._hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def pending(self, final: bool) -> str:
        """Text not yet emitted; while running, holds back a possible stop-string start."""
        end = len(self.text) if (final or self.stopped) else len(self.text) - self._hold
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
