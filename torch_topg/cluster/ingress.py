"""The HTTP front of the replicas: the ``router`` deployment of the application.

Every request is read here (its session: ``session_id`` or else ``user``; its prompt's
block hashes, from the tokenizer and chat template the replicas use), sent through the
``engine`` deployment's handle, whose request router is the prefix router
(:mod:`torch_topg.cluster.serve_router`), and relayed back as the replica answers it,
SSE chunk by chunk.

**A replica that dies.** A request whose replica fails before the first byte of its
answer reached the client (not yet streaming) is sent again, to another replica (up to
``max_attempts`` tries); the dead replica is marked so (Serve starts a replacement). A
streamed answer already under way ends with an error event naming the replica and the
reason, then ``data: [DONE]``; a replica that sends nothing for ``stall_timeout_s``
counts as failed. Nothing waits forever.

``GET /metrics`` sums the replicas' metrics (counters, histograms and most gauges add
up; usage fractions are averaged) and adds the router's own (``topg_router_*``);
``GET /cluster`` is the router's state as JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.exceptions import RayActorError, RayError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from torch_topg.cluster.metrics import merge_metrics, router_metrics
from torch_topg.cluster.replica import Route, RouterOptions
from torch_topg.cluster.router import block_hashes, core_for
from torch_topg.engine.kv_events import decode

log = logging.getLogger("torch_topg.cluster")


class ReplicaFailed(Exception):
    def __init__(self, replica: str | None, reason: str) -> None:
        super().__init__(f"replica {replica or '?'} failed: {reason}")
        self.replica, self.reason = replica, reason


class ClusterIngress:
    """The body of the ``router`` deployment (deploy.py)."""

    def __init__(self, engines: Any, options: RouterOptions) -> None:
        self.engines = engines
        self.opts = options
        app = serve.get_replica_context().app_name
        thresholds = (options.load_ratio, options.load_floor, options.min_prefix_share)
        self.core = core_for(app, thresholds)
        self.tokenizer, self.vocab = options.tokenizer() if options.tokenizer else (None, 0)
        self.renderer: Any = None
        self.info: dict[str, Any] | None = None  # root, block size, context (from a replica)
        self.retries = 0
        self.failed_streams = 0
        self.pids: dict[str, int] = {}

    # --- routing keys ------------------------------------------------------------------
    def _keys(self, path: str, body: bytes) -> tuple[list[bytes], str | None]:
        """(the prompt's block hashes, the session); best effort: what cannot be read
        here routes by session and load only (the replica answers the error itself)."""
        try:
            fields = json.loads(body) if body else {}
        except ValueError:
            return [], None
        if not isinstance(fields, dict):
            return [], None
        sid = fields.get("session_id") or fields.get("user")
        session = sid if isinstance(sid, str) else None
        if self.tokenizer is None or self.info is None:
            return [], session
        try:
            ids = self._prompt_ids(path, fields)
        except Exception:  # malformed: the replica's 400 says why
            ids = []
        return block_hashes(self.info["root"], ids, self.info["block_size"]), session

    def _prompt_ids(self, path: str, fields: dict[str, Any]) -> list[int]:
        if path == "/v1/chat/completions":
            from torch_topg.serve.chat_template import ChatRenderer
            from torch_topg.serve.protocol import parse_chat

            if self.renderer is None:
                self.renderer = ChatRenderer(self.tokenizer, self.opts.chat_template)
            req = parse_chat(fields, str(fields.get("model", "")), self.info["max_model_len"])
            return self.renderer.render_ids(req.chat)[1]
        if path == "/v1/completions":
            from torch_topg.engine.inputs import tokenize

            prompt = fields.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: the first one's replica
            return tokenize(prompt, self.tokenizer, self.vocab)[1]
        return []

    def _events(self, replica: str, sent: int, nxt: int, data: bytes) -> None:
        self.core.apply_events(replica, sent, nxt, decode(data))

    # --- HTTP --------------------------------------------------------------------------
    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        if not self.core.replicas:
            await self._warm()
        if path == "/health":
            ok = bool(self.core.live())
            return JSONResponse({"status": "ok" if ok else "no replica"}, status_code=200 if ok else 503)  # fmt: skip
        if path == "/metrics":
            return Response(await self._metrics(), media_type="text/plain; version=0.0.4")
        if path == "/cluster":
            return JSONResponse({**self.core.state(), "retries": self.retries,
                                 "failed_streams": self.failed_streams, "pids": self.pids})  # fmt: skip
        body = await request.body()
        req = {
            "method": request.method, "path": path, "body": body,
            "query_string": request.url.query.encode(),
            "headers": [(k.encode(), v.encode()) for k, v in request.headers.items()],
        }  # fmt: skip
        # off the event loop: a long prompt's chat template and tokenizer take milliseconds
        hashes, session = await asyncio.to_thread(self._keys, path, body)
        last = "no replica answered"
        for attempt in range(self.opts.max_attempts):
            route = Route(hashes, session, self.core.cursors())
            gen = self.engines.options(stream=True).handle.remote(req, route=route)
            try:
                return await self._answer(gen, route)
            except ReplicaFailed as e:
                last = str(e)
                if e.replica is not None:
                    self.core.mark_dead(e.replica)
                self.retries += attempt + 1 < self.opts.max_attempts
                log.warning("%s; %s", e, "retrying" if attempt + 1 < self.opts.max_attempts else "giving up")  # fmt: skip
        err = {"message": f"no replica could answer: {last}", "type": "server_error", "code": 503}
        return JSONResponse({"error": err}, status_code=503)

    async def _warm(self) -> None:
        """One call through the handle: Serve's router starts with the first call and
        only then tells the core which replicas exist."""
        try:
            await asyncio.wait_for(self.engines.describe.remote(), timeout=10.0)
        except (asyncio.TimeoutError, RayError):
            pass

    async def _next(self, gen: Any, route: Route, stall: bool = True) -> Any:
        """The replica's next message; ``stall``: fail after ``stall_timeout_s`` of silence
        (not while a non-streamed answer is generated: it arrives whole, at the end)."""
        try:
            timeout = self.opts.stall_timeout_s if stall else None
            return await asyncio.wait_for(gen.__anext__(), timeout=timeout)
        except StopAsyncIteration:
            raise
        except asyncio.TimeoutError:
            gen.cancel()
            raise ReplicaFailed(route.replica, f"no answer for {self.opts.stall_timeout_s:g} s") from None  # fmt: skip
        except RayActorError as e:
            raise ReplicaFailed(route.replica, f"the replica died ({type(e).__name__})") from None
        except RayError as e:
            raise ReplicaFailed(route.replica, f"{type(e).__name__}: {e}") from None

    async def _answer(self, gen: Any, route: Route) -> Response:
        """Read the head, the status and (streams) the first chunk before answering: a
        failure until then is retried elsewhere."""
        head = await self._next(gen, route)
        _, rid, sent, nxt, events, info = head
        route.replica = rid
        self.info = self.info or info
        self.pids[rid] = info["pid"]
        self._events(rid, sent, nxt, events)
        _, start = await self._next(gen, route)
        headers = {k.decode(): v.decode() for k, v in start["headers"]}
        headers.pop("content-length", None)
        headers["x-topg-replica"] = rid  # which replica answered, and why it was chosen
        headers["x-topg-route"] = route.reason or "serve"
        stream = headers.get("content-type", "").startswith("text/event-stream")
        chunks: list[bytes] = []
        while True:
            try:
                msg = await self._next(gen, route, stall=stream)
            except StopAsyncIteration:
                break
            if msg[0] == "tail":
                self._events(*msg[1:])
                continue
            chunks.append(msg[1])
            if stream:
                break  # streaming: from here on a failure is the client's error event
        if not stream:
            return Response(b"".join(chunks), status_code=start["status"], headers=headers)
        return StreamingResponse(self._relay(gen, route, chunks), status_code=start["status"],
                                 headers=headers)  # fmt: skip

    async def _relay(self, gen: Any, route: Route, first: list[bytes]) -> AsyncIterator[bytes]:
        ended = False
        try:
            for c in first:
                yield c
            async for chunk in self._chunks(gen, route):
                yield chunk
            ended = True
        finally:
            if not ended:  # the client went away: cancel the call, the replica aborts
                gen.cancel()

    async def _chunks(self, gen: Any, route: Route) -> AsyncIterator[bytes]:
        while True:
            try:
                msg = await self._next(gen, route)
            except StopAsyncIteration:
                return
            except ReplicaFailed as e:
                self.failed_streams += 1
                if e.replica is not None:
                    self.core.mark_dead(e.replica)
                err = {"error": {"message": str(e), "type": "server_error", "code": 503}}
                yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
                return
            if msg[0] == "tail":
                self._events(*msg[1:])
            else:
                yield msg[1]

    async def _metrics(self) -> bytes:
        texts: list[bytes] = []
        for rid in self.core.live():
            call = self.engines.metrics.remote(route=Route(pin=rid))
            try:
                texts.append(await asyncio.wait_for(call, timeout=5.0))
            except (asyncio.TimeoutError, RayError):
                continue  # a replica that does not answer is left out of this scrape
        extra = router_metrics(self.core.state(), self.retries, self.failed_streams, time.time())
        return merge_metrics([t.decode() for t in texts]) + extra
