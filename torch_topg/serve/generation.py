"""One completion request against the engine: submit its prompts, then either wait for
the whole output or stream OpenAI chunks; a client that goes away aborts its requests."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from torch_topg.engine import Delta, Engine, QueueFull, RequestHandle, RequestOutput
from torch_topg.serve.echo import StreamEcho, echo_text, prompt_parts, with_echo
from torch_topg.serve.errors import APIError, from_engine_error
from torch_topg.serve.metrics import ServerMetrics
from torch_topg.serve.protocol import GenerationRequest
from torch_topg.serve.responses import (
    DONE,
    Response,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage,
)
from torch_topg.serve.tools import OutputSpec, event_delta, finish_reason

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks for its client
RETRY_AFTER_S = 1  # a 429's Retry-After: the queue moves at every engine step


async def compile_constraint(engine: Engine, req: GenerationRequest) -> None:
    """Compile the request's structured-output constraint off the event loop (the engine
    caches it, so ``submit`` finds it ready); a 400 naming the field when it does not
    compile."""
    spec = req.sampling.get("structured")
    if spec is None:
        return
    try:
        await asyncio.to_thread(engine.compile_structured, spec)
    except ValueError as e:
        raise from_engine_error(e, req.renames) from None


def submit(engine: Engine, req: GenerationRequest) -> list[RequestHandle]:
    """One engine request per prompt; all or none (a refused one aborts the others)."""
    options = dict(req.sampling)
    if req.session_id is not None:
        options["session_id"] = req.session_id
    handles: list[RequestHandle] = []
    try:
        for x in req.inputs:
            handles.append(engine.submit(x, **options))
    except ValueError as e:
        _abort(handles)
        raise from_engine_error(e, req.renames) from None
    except QueueFull as e:
        _abort(handles)
        raise APIError(str(e), status=429, type="rate_limit_error",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None  # fmt: skip
    except RuntimeError as e:  # submit after shutdown
        _abort(handles)
        raise APIError(str(e), status=503, type="server_error") from None
    return handles


def _abort(handles: list[RequestHandle]) -> None:
    for h in handles:
        h.abort()


def abort_unfinished(handles: list[RequestHandle]) -> None:
    """Abort the handles that have not finished (finished ones are left alone)."""
    _abort([h for h in handles if not h.finished])


def _logprobs(resp: Response, lps: Any, text: TokenText, k: int, offset: int = 0) -> Any:
    if not lps:
        return None
    if resp.kind == "chat":
        return chat_logprobs(lps, text, k)
    return completion_logprobs(lps, text, k, offset)


async def _drain(handle: RequestHandle) -> RequestOutput:
    async for _ in handle:
        pass
    return handle.result()


async def complete(
    resp: Response,
    req: GenerationRequest,
    handles: list[RequestHandle],
    text: TokenText,
    metrics: ServerMetrics,
    disconnected: Callable[[], Awaitable[bool]],
    start: float,
) -> dict[str, Any]:
    """The whole response body once every prompt's samples have finished."""
    task = asyncio.ensure_future(asyncio.gather(*(_drain(h) for h in handles)))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                break
            if await disconnected():
                _abort(handles)
                metrics.aborted(len(handles) * req.n)
                raise APIError("the client disconnected", status=499)
        outputs: list[RequestOutput] = task.result()
    except Exception as e:
        raise _engine_failure(e) from None
    finally:
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)  # else asyncio logs "never retrieved"
    metrics.observe(outputs, start)
    choices = []
    for p, out in enumerate(outputs):
        prefix = echo_text(req, p, text)
        for sample in out.outputs:
            lp = None
            if req.logprobs is not None:
                lp = _logprobs(resp, sample.logprobs or [], text, req.logprobs, len(prefix))
                lp = with_echo(req, prefix, out.prompt_token_ids, out.prompt_logprobs, lp, text)
            index, reason = p * req.n + sample.index, sample.finish_reason
            if req.output is None:
                choices.append(resp.choice(index, prefix + sample.text, reason, lp))
                if resp.kind == "text":
                    prompt_parts(req, choices[-1], out.prompt_logprobs, text)
                continue
            msg = req.output.message(sample.text)
            reason = finish_reason(reason, bool(msg.get("tool_calls")))
            choices.append(resp.choice(index, sample.text, reason, lp, message=msg))
    body = resp.body(choices, usage(outputs))
    if resp.kind == "chat" and req.prompt_logprobs is not None:  # vLLM's: one prompt
        prompt_parts(req, body, outputs[0].prompt_logprobs, text)
    return body


def _retrieve(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()


def _engine_failure(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    return APIError(f"the request failed in the engine: {e!r}", status=500, type="server_error")


async def _merge(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt index, delta) from several handles as they come."""
    if len(handles) == 1:
        async for d in handles[0]:
            yield 0, d
        return
    queue: asyncio.Queue[tuple[int, Delta | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, h: RequestHandle) -> None:
        try:
            async for d in h:
                queue.put_nowait((i, d, None))
            queue.put_nowait((i, None, None))
        except Exception as e:
            queue.put_nowait((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, d, err = await queue.get()
            if err is not None:
                raise err
            if d is None:
                left -= 1
                continue
            yield i, d
    finally:
        for t in tasks:
            t.cancel()  # leaving a handle's iteration aborts its request


async def stream(
    resp: Response,
    req: GenerationRequest,
    handles: list[RequestHandle],
    text: TokenText,
    metrics: ServerMetrics,
    start: float,
) -> AsyncIterator[str]:
    """SSE events: for chat a role chunk per choice first, then a chunk per delta that
    has text, logprobs or a finish reason, the usage chunk (``include_usage``), then
    ``data: [DONE]``. An engine failure becomes an error event before ``[DONE]``. When
    the client disconnects the generator is closed and the requests are aborted."""
    inc = req.include_usage
    choices = len(handles) * req.n
    offsets = [0] * choices  # legacy logprobs' text offsets
    usages: list[dict[str, Any]] = []
    finished = False
    parsers = _ChoiceParsers(resp, req.output, choices) if req.output is not None else None
    echo = StreamEcho(req, text)
    try:
        if resp.kind == "chat":
            for c in range(choices):
                yield resp.chunk([resp.chunk_choice(c, "", role=True)], None, inc)
        async for p, d in _merge(handles):
            if d.usage is not None:
                usages.append(d.usage)
            echo.seen(p, d.prompt_token_ids, d.prompt_logprobs)
            if not (d.text or d.logprobs or d.finish_reason):
                continue
            c = p * req.n + d.index
            lp, extra = None, {}
            if echo.active and c not in echo.started:
                offsets[c] = echo.offset(p)
            if req.logprobs is not None and d.logprobs:
                lp = _logprobs(resp, d.logprobs, text, req.logprobs, offsets[c])
                offsets[c] += sum(len(text(t.token_id)) for t in d.logprobs)
            if echo.active and resp.kind == "text":
                d.text, lp, extra = echo.first(p, c, d.text, lp)
            if parsers is not None:
                for chunk in parsers.chunks(c, d.text, d.finish_reason, lp):
                    yield resp.chunk([chunk], None, inc)
                continue
            content = d.text if (d.text or resp.kind != "chat") else None
            chunk = resp.chunk_choice(c, content, d.finish_reason, lp)
            yield resp.chunk([{**chunk, **extra}], None, inc)
        finished = True
        metrics.observe([h.result() for h in handles], start)
        if inc:
            yield resp.chunk([], usage(usages), True)
    except Exception as e:
        err = _engine_failure(e)
        yield sse(err.body())
    finally:
        if not finished:
            _closed_early(handles, metrics, choices, start)
    yield DONE


class _ChoiceParsers:
    """The parsed chat stream: per choice an output parser; each engine delta becomes the
    chunks of its events (reasoning, content, one per call delta), logprobs on the first
    (carried to the next chunk when the delta's text was held back), the finish reason
    on the last (``tool_calls`` when calls were made)."""

    def __init__(self, resp: Response, spec: OutputSpec, choices: int) -> None:
        self.resp = resp
        self.parsers = [spec.parser() for _ in range(choices)]
        self.called = [False] * choices
        self.held: list[list[Any]] = [[] for _ in range(choices)]  # logprobs not yet sent

    def chunks(self, c: int, text: str, reason: str | None, lp: Any) -> list[dict[str, Any]]:
        p = self.parsers[c]
        events = p.feed(text) if text else []
        if reason is not None:
            events += p.finish()
        if lp:
            self.held[c] += lp["content"]
        deltas = [event_delta(e) for e in events]
        self.called[c] |= any("tool_calls" in d for d in deltas)
        if reason is not None and not deltas:
            deltas = [{}]
        out = []
        for k, delta in enumerate(deltas):
            logprobs = None
            if k == 0 and self.held[c]:
                logprobs, self.held[c] = {"content": self.held[c]}, []
            last = k == len(deltas) - 1
            why = finish_reason(reason, self.called[c]) if last else None
            out.append(self.resp.delta_choice(c, delta, why, logprobs))
        return out


def _closed_early(
    handles: list[RequestHandle], metrics: ServerMetrics, choices: int, start: float
) -> None:
    """A stream left before its end (client gone, engine error): abort what still runs.
    A sample is counted once in the metrics: by its own finish reason when all had ended
    before the client left, else as an abort."""
    if not all(h.finished for h in handles):
        _abort(handles)
        metrics.aborted(choices)
        return
    with contextlib.suppress(Exception):  # a failed request (its error was sent) is not counted
        metrics.observe([h.result(timeout=0) for h in handles], start)


def now() -> float:
    return time.perf_counter()
