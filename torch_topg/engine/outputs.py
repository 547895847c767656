"""What the engine returns: per-request outputs, streamed deltas and request handles."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TokenLogprob:
    """The sampled token's log-probability and the row's top alternatives."""

    token_id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)
    rank: int | None = None  # prompt logprobs: the token's rank in its row (1: the likeliest)


@dataclass
class CompletionOutput:
    """One sample (of ``n``) of a request."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    # Seconds from the request's arrival to each token (the first one is the TTFT).
    token_times: list[float] = field(default_factory=list)
    # Speculative decoding's figures for this sample (SpecStats.as_dict), when it ran.
    speculative: dict[str, Any] | None = None


@dataclass
class RequestOutput:
    """The result of one input of :meth:`Engine.generate`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    cached_prompt_tokens: int = 0
    error: BaseException | None = None
    # prompt_logprobs: one entry per prompt token, the first None (nothing before it)
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token of any sample."""
        firsts = [o.token_times[0] for o in self.outputs if o.token_times]
        return min(firsts) if firsts else None

    @property
    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }


@dataclass
class Delta:
    """What one step added to one sample of a request (streamed by a handle)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # set on the sample's last delta
    usage: dict[str, Any] | None = None  # set on the request's last delta
    # prompt_logprobs: set on the request's first delta (RequestOutput.prompt_logprobs),
    # with the prompt's token ids
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_token_ids: list[int] | None = None


class RequestAborted(Exception):
    """The request was aborted before it produced its result."""


class RequestHandle:
    """A submitted request: iterate it (plain or ``async for``) for :class:`Delta` s.

    Leaving an iteration early (``break``, an exception, a cancelled task) aborts the
    request and frees its KV blocks. :meth:`result` waits for the whole output.

    Contract: ``_push`` and ``_finish`` are the engine's side of the handle, called by the
    engine loop (``engine.py``) only, the one producer of a handle's deltas.
    """

    def __init__(self, request_id: str, abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._abort = abort
        self._lock = threading.Lock()
        # Two conditions on one lock: result() is woken once, at the end; a streaming
        # iterator at every delta. (Waking a result() waiter at every token handed the
        # GIL to the caller's thread once a step, for nothing.)
        self._cond = threading.Condition(self._lock)
        self._stream = threading.Condition(self._lock)
        self._deltas: deque[Delta] = deque()
        self._done = False
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # --- engine side -------------------------------------------------------------------
    def _push(self, delta: Delta) -> None:
        with self._lock:
            self._deltas.append(delta)
            self._wake()

    def _finish(self, output: RequestOutput | None, error: BaseException | None) -> None:
        with self._lock:
            self._output, self._error, self._done = output, error, True
            self._cond.notify_all()
            self._wake()

    def _wake(self) -> None:  # holds the lock
        self._stream.notify_all()
        for loop, event in self._waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop is closed
                pass
        self._waiters.clear()

    # --- user side ---------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._done

    def abort(self) -> None:
        """Stop generating; the output ends with ``finish_reason="abort"``."""
        if not self._done:
            self._abort(self.request_id)

    def result(self, timeout: float | None = None) -> RequestOutput:
        """The whole output (waits for the end); raises the request's error if it failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output

    def _next(self) -> Delta | None:  # holds the lock; None = nothing now
        return self._deltas.popleft() if self._deltas else None

    def __iter__(self) -> Iterator[Delta]:
        completed = False
        try:
            while True:
                with self._stream:
                    self._stream.wait_for(lambda: self._deltas or self._done)
                    d = self._next()
                    if d is None:  # done and drained
                        if self._error is not None:
                            raise self._error
                        completed = True
                        return
                yield d
        finally:
            if not completed:
                self.abort()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        loop = asyncio.get_running_loop()
        completed = False
        try:
            while True:
                with self._lock:
                    d = self._next()
                    if d is None and self._done:
                        if self._error is not None:
                            raise self._error
                        completed = True
                        return
                    event = None
                    if d is None:
                        event = asyncio.Event()
                        self._waiters.append((loop, event))
                if event is not None:
                    await event.wait()
                    continue
                yield d
        finally:
            if not completed:
                self.abort()
