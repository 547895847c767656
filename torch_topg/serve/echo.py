"""``echo`` and ``prompt_logprobs`` of a completion: what a choice carries about its
prompt, whole (:func:`prompt_parts`) or on a stream's first chunk (:class:`StreamEcho`).

``echo`` (OpenAI's legacy completions): the choice's text starts with the prompt's text
(the string given, or the decoded ids); with ``logprobs`` its ``logprobs`` start with the
prompt's tokens, the first with null values. ``prompt_logprobs`` (vLLM's): a list, per
prompt token, of None (the first) or its logprob, rank and top alternatives.
"""

from __future__ import annotations

from typing import Any

from torch_topg.engine import TokenLogprob
from torch_topg.serve.protocol import GenerationRequest
from torch_topg.serve.responses import TokenText, echo_logprobs, joined_logprobs, prompt_logprobs


def echo_text(req: GenerationRequest, p: int, text: TokenText) -> str:
    """The echoed text of prompt ``p`` ("" without ``echo``)."""
    if not req.echo:
        return ""
    x = req.inputs[p]
    return x if isinstance(x, str) else text.decode(list(x))


def with_echo(
    req: GenerationRequest,
    prefix: str,
    ids: list[int],
    plps: list[TokenLogprob | None] | None,
    lp: dict[str, Any] | None,
    text: TokenText,
) -> dict[str, Any] | None:
    """A legacy choice's ``logprobs`` (``lp``, its offsets already past ``prefix``) with
    the echoed prompt's tokens first."""
    if not req.echo or req.logprobs is None or plps is None:
        return lp
    head = echo_logprobs(ids, plps, text, req.logprobs)
    return joined_logprobs(head, lp)


def prompt_parts(
    req: GenerationRequest, choice: dict[str, Any], plps: Any, text: TokenText
) -> None:
    """Add ``prompt_logprobs`` to a completion choice when the request asked."""
    if req.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs(plps, text, req.prompt_logprobs)


class StreamEcho:
    """A stream's echo: per choice, the prompt's text (and logprobs) go on its first
    chunk; the prompt logprobs arrive on a request's first delta (kept per prompt)."""

    def __init__(self, req: GenerationRequest, text: TokenText) -> None:
        self.req, self.text = req, text
        self.plps: dict[int, tuple[list[int], Any]] = {}
        self.started: set[int] = set()

    @property
    def active(self) -> bool:
        return self.req.echo or self.req.prompt_logprobs is not None

    def seen(self, p: int, ids: list[int] | None, plps: Any) -> None:
        """A delta of prompt ``p`` arrived (its prompt's ids and logprobs, if on it)."""
        if plps is not None and ids is not None:
            self.plps[p] = (ids, plps)

    def offset(self, p: int) -> int:
        """Where a choice of prompt ``p``'s own text starts (after its echo)."""
        return len(echo_text(self.req, p, self.text))

    def first(
        self, p: int, c: int, content: str, lp: dict[str, Any] | None
    ) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
        """(text, logprobs, extra choice fields) of choice ``c``'s chunk: the echo in
        front on its first chunk."""
        if c in self.started:
            return content, lp, {}
        self.started.add(c)
        prefix = echo_text(self.req, p, self.text)
        ids, plps = self.plps.get(p, ([], None))
        lp = with_echo(self.req, prefix, ids, plps, lp, self.text)
        extra: dict[str, Any] = {}
        prompt_parts(self.req, extra, plps, self.text)
        return prefix + content, lp, extra
