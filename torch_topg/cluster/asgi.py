"""Calling the server's ASGI app in process, its response as an async iterator.

A replica runs the same FastAPI app as ``python -m torch_topg serve`` and the router
hands it each HTTP request as a plain dict (method, path, query, headers, body) through
Ray; the response comes back as messages: the status and headers first, then the body
chunks as the app sends them (an SSE stream chunk by chunk). When the consumer stops
early (the client went away, or Ray cancelled the call), the app sees a disconnect, so
the engine aborts the request as it would for a direct client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

HTTPRequest = dict[str, Any]  # method, path, query_string, headers [(bytes, bytes)], body


async def call_asgi(app: Any, req: HTTPRequest) -> AsyncIterator[dict[str, Any] | bytes]:
    """``{"status", "headers"}`` once, then ``bytes`` chunks of the body."""
    queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.get("body", b""), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await queue.put(message)

    path = req["path"]
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": req.get("method", "GET"), "scheme": "http", "path": path,
        "raw_path": path.encode(), "root_path": "", "query_string": req.get("query_string", b""),
        "headers": [(bytes(k).lower(), bytes(v)) for k, v in req.get("headers", [])],
        "client": ("router", 0), "server": ("replica", 0),
    }  # fmt: skip
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: queue.put_nowait(None))
    try:
        while True:
            msg = await queue.get()
            if msg is None:
                break
            if msg["type"] == "http.response.start":
                yield {"status": msg["status"], "headers": list(msg.get("headers", []))}
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    break
        await task  # the app's own exception, if any, is the caller's
    finally:
        gone.set()  # a consumer that stopped early: the app sees its client leave
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)
            task.cancel()
