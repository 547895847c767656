"""OpenAI response bodies and streamed chunks built from the engine's outputs."""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from torch_topg.engine import RequestOutput, TokenLogprob


def usage(outputs: list[RequestOutput] | list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's usage object, summed over the prompts of a request.

    Accepts engine outputs or the engine's usage dicts (a request's last delta)."""
    dicts = [o.usage if isinstance(o, RequestOutput) else o for o in outputs]
    prompt = sum(d["prompt_tokens"] for d in dicts)
    completion = sum(d["completion_tokens"] for d in dicts)
    cached = sum(d.get("cached_prompt_tokens", 0) for d in dicts)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class TokenText:
    """Token id -> its text and its bytes (cached; without a tokenizer ``token_id:N``).

    A token can be part of a UTF-8 character (byte-level BPE): its decoded text is then
    U+FFFD, and :meth:`bytes` recovers the exact bytes from the token's own spelling
    (GPT-2's byte alphabet, or SentencePiece's ``<0xNN>``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            if self._tok is None:
                s = f"token_id:{token_id}"
            else:
                s = self._tok.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 200_000:
                self._cache[token_id] = s
        return s

    def decode(self, ids: list[int]) -> str:
        """The text of a token id list (a prompt given as ids, echoed)."""
        if self._tok is None:
            return "".join(self(t) for t in ids)
        return self._tok.decode(ids, skip_special_tokens=False)

    def bytes(self, token_id: int) -> list[int]:
        s = self(token_id)
        if "\ufffd" in s and self._tok is not None:
            piece = self._tok.convert_ids_to_tokens(token_id)
            if isinstance(piece, str):
                m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
                if m:
                    return [int(m.group(1), 16)]
                table = _byte_decoder()
                if piece and all(c in table for c in piece):
                    return [table[c] for c in piece]
        return list(s.encode("utf-8"))


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: printable stand-in -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def chat_logprobs(lps: list[TokenLogprob], text: TokenText, k: int) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (``{"content": [...]}``)."""

    def entry(tid: int, lp: float) -> dict[str, Any]:
        return {"token": text(tid), "logprob": _finite(lp), "bytes": text.bytes(tid)}

    return {
        "content": [
            {**entry(t.token_id, t.logprob),
             "top_logprobs": [entry(a, v) for a, v in list(t.top.items())[:k]]}
            for t in lps
        ]
    }  # fmt: skip


def completion_logprobs(
    lps: list[TokenLogprob], text: TokenText, k: int, offset: int = 0
) -> dict[str, Any]:
    """``choices[i].logprobs`` of a (legacy) completion; ``offset``: the text offset of
    the first token (streamed chunks continue where the previous one stopped)."""
    tokens, offsets = [], []
    for t in lps:
        s = text(t.token_id)
        offsets.append(offset)
        tokens.append(s)
        offset += len(s)
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(t.logprob) for t in lps],
        # keyed by text: tokens that print the same (U+FFFD) keep the likeliest one
        "top_logprobs": [_top_by_text(t, text, k) if k else None for t in lps],
        "text_offset": offsets,
    }


def prompt_logprobs(
    lps: list[TokenLogprob | None] | None, text: TokenText, k: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or ``{token id (a
    string): {"logprob", "rank", "decoded_token"}}`` holding the prompt token and its
    position's top-``k`` alternatives (ranks 1..k)."""
    if lps is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for t in lps:
        if t is None:
            out.append(None)
            continue
        entry = {
            str(a): {"logprob": _finite(v), "rank": r, "decoded_token": text(a)}
            for r, (a, v) in enumerate(list(t.top.items())[:k], start=1)
        }
        entry[str(t.token_id)] = {"logprob": _finite(t.logprob), "rank": t.rank,
                                  "decoded_token": text(t.token_id)}  # fmt: skip
        out.append(entry)
    return out


def echo_logprobs(
    ids: list[int], lps: list[TokenLogprob | None], text: TokenText, k: int
) -> dict[str, Any]:
    """The legacy completion ``logprobs`` of an echoed prompt (token ``ids``, their
    prompt logprobs ``lps``): its tokens from offset 0, the first with null logprobs
    (nothing comes before it), as OpenAI's ``echo``."""
    tokens, offsets, values, tops = [], [], [], []
    offset = 0
    for tid, t in zip(ids, lps, strict=True):
        tokens.append(text(tid))
        offsets.append(offset)
        offset += len(tokens[-1])
        values.append(None if t is None else _finite(t.logprob))
        tops.append(None if t is None or not k else _top_by_text(t, text, k))
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def joined_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two legacy ``logprobs`` objects as one (the echoed prompt's, then the choice's)."""
    if then is None:
        return first
    return {key: first[key] + then[key] for key in first}


def _top_by_text(t: TokenLogprob, text: TokenText, k: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for a, v in list(t.top.items())[:k]:
        out.setdefault(text(a), _finite(v))
    return out


def _finite(x: float) -> float:
    # JSON has no -Infinity; OpenAI clients expect a number. -9999.0 is vLLM's choice.
    return x if x == x and x > -1e30 else -9999.0


@dataclass
class Response:
    """Ids and constants shared by a response's body or its chunks."""

    kind: str  # "chat" | "text"
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
            self.id = f"{prefix}-{uuid.uuid4().hex}"

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def body(self, choices: list[dict[str, Any]], use: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": use,
        }

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: Any = None,
        message: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A choice of a whole response; chat: ``message`` (content, reasoning, tool
        calls) when the output was parsed, else the text as content."""
        if self.kind == "chat":
            return {
                "index": index,
                "message": message or {"role": "assistant", "content": text},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(
        self,
        choices: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        include_usage: bool = False,
    ) -> str:
        """One SSE event; with ``include_usage`` every chunk carries ``usage`` (null
        except on the last one, OpenAI's format)."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if include_usage:
            body["usage"] = usage
        return sse(body)

    def chunk_choice(
        self,
        index: int,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: Any = None,
        role: bool = False,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            return {
                "index": index,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {
            "index": index,
            "text": text or "",
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }

    def delta_choice(
        self,
        index: int,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        logprobs: Any = None,
    ) -> dict[str, Any]:
        """A chat chunk's choice with a ready ``delta`` (content, reasoning_content or
        tool_calls)."""
        return {"index": index, "delta": delta, "logprobs": logprobs,
                "finish_reason": finish_reason}  # fmt: skip


def sse(obj: Any) -> str:
    """A server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"
