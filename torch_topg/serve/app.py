"""The FastAPI application: OpenAI-compatible endpoints on a :class:`torch_topg.Engine`.

``create_app(engine, model_name)`` builds it; the CLI (``python -m torch_topg serve``)
builds it with ``engine=None`` and hands the engine over with :meth:`ServerState.set_engine`
once loaded, so ``GET /health`` answers 503 while the model loads.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from torch_topg.engine import Engine
from torch_topg.engine.embedding_model import EmbeddingModel
from torch_topg.serve import generation
from torch_topg.serve.chat_template import ChatOptions, ChatRenderer
from torch_topg.serve.embeddings import embeddings_body
from torch_topg.serve.errors import APIError
from torch_topg.serve.metrics import CONTENT_TYPE, ServerMetrics
from torch_topg.serve.playground import PAGE
from torch_topg.serve.protocol import GenerationRequest, parse_chat, parse_completion
from torch_topg.serve.responses import Response as Body
from torch_topg.serve.responses import TokenText
from torch_topg.serve.responses_api import ResponseObject, events, rename, to_chat
from torch_topg.serve.tokenize import detokenize_body, tokenize_body
from torch_topg.serve.tools import (
    ForcedToolParser,
    OutputSpec,
    constrain_to_tool_call,
    tool_call_schema,
)

_ENDPOINTS = ("/", "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
              "/tokenize", "/detokenize", "/v1/embeddings", "/v1/responses")  # fmt: skip


class ServerState:
    """What the routes share: the engine (None while loading), the served name, metrics.
    A server of an embedding model (``--task embed``) holds an :class:`EmbeddingModel`
    instead of an engine, and answers only ``/v1/embeddings`` and ``/v1/models``."""

    def __init__(
        self,
        engine: Engine | EmbeddingModel | None,
        model_name: str,
        api_keys: tuple[str, ...] = (),
        chat: ChatOptions | None = None,
    ) -> None:
        self.engine: Engine | None = None
        self.embedder: EmbeddingModel | None = None
        self.model_name = model_name
        self.api_keys = api_keys
        self.created = int(time.time())
        self.metrics = ServerMetrics(lambda: self.engine, lambda: self.model_name)
        self.text = TokenText(None)
        self.chat_options = chat or ChatOptions()
        self.chat: ChatRenderer | None = None
        if isinstance(engine, EmbeddingModel):
            self.set_embedder(engine)
        elif engine is not None:
            self.set_engine(engine)

    def set_embedder(self, model: EmbeddingModel) -> None:
        """The embedding model is loaded: serve ``/v1/embeddings`` (``/health`` turns 200)."""
        self.text = TokenText(model.tokenizer)
        self.embedder = model

    def set_engine(self, engine: Engine) -> None:
        """The model is loaded: start serving it (``/health`` turns 200)."""
        self.text = TokenText(engine.tokenizer)
        o = self.chat_options
        self.chat = ChatRenderer(
            engine.tokenizer, o.template, o.tool_parser, o.reasoning_parser,
            getattr(getattr(engine.model, "config", None), "model_type", None),
        )  # fmt: skip
        self.engine = engine

    @property
    def ready(self) -> bool:
        return self.engine is not None or self.embedder is not None

    def require_engine(self) -> Engine:
        if self.engine is None and self.embedder is not None:
            raise APIError(
                "this server serves an embedding model (--task embed): only /v1/embeddings "
                "and /v1/models are available", code="model_not_supported",
            )  # fmt: skip
        if self.engine is None:
            raise APIError("the model is still loading; retry shortly", status=503,
                           type="server_error")  # fmt: skip
        return self.engine


def create_app(
    engine: Engine | EmbeddingModel | None,
    model_name: str,
    *,
    api_key: str | Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    chat: ChatOptions | None = None,
    pooling: str | None = None,
) -> FastAPI:
    """The server's app over ``engine`` (None: loading, see :class:`ServerState`).

    ``model_name`` is what ``/v1/models`` lists and requests may name; ``api_key``: one
    key or several; when given, every ``/v1`` request needs ``Authorization: Bearer <key>``
    with one of them (401 otherwise). ``allowed_origins``: browser origins allowed by CORS
    (``"*"``: any). ``chat``: the chat template and output parsers (:class:`ChatOptions`).
    ``pooling``: how ``/v1/embeddings`` pools the hidden states (``"last"``, ``"mean"``;
    None: an embedding model's own, ``"last"`` for an engine's model). ``engine`` may be an
    :class:`EmbeddingModel` (a server of embeddings only).
    The app never shuts the engine down: its owner does.
    """
    app = FastAPI(title="torch_topg", docs_url=None, redoc_url=None, openapi_url=None)
    keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
    state = ServerState(engine, model_name, keys, chat)
    app.state.topg = state

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(str(exc.detail), status=exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:  # a bug: still JSON
        err = APIError(f"internal error: {exc!r}", status=500, type="server_error")
        return JSONResponse(err.body(), status_code=500)

    # A plain ASGI middleware: FastAPI's @app.middleware("http") wraps `receive`, and
    # behind it request.is_disconnected() never sees the client go.
    app.add_middleware(_Gate, state=state)
    if allowed_origins:  # outermost: preflight requests are answered before the key check
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"], allow_headers=["*"])  # fmt: skip

    @app.get("/")
    async def playground() -> HTMLResponse:  # open like /health: the page asks for the key
        return HTMLResponse(PAGE)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        lost = getattr(getattr(state.engine, "runner", None), "broken", None)
        if lost is not None:  # a lost worker or node: restart the service (cluster.md)
            return JSONResponse({"status": "dead", "error": lost}, status_code=503)
        # warm: the warm-up's background compile is done (or there is none); a benchmark
        # waits for it, a client need not (requests are served meanwhile)
        state_ = getattr(getattr(state.engine, "runner", None), "background_state", "off")
        return JSONResponse({"status": "ok", "warm": state_ != "compiling"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "torch_topg",
        }
        if state.engine is not None:
            card["max_model_len"] = state.engine.config.max_model_len
        elif state.embedder is not None:
            card["max_model_len"] = state.embedder.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        start = generation.now()
        body = await _json(request)
        eng = state.require_engine()
        req = parse_completion(body, state.model_name)
        return await _generate(state, request, eng, req, Body("text", state.model_name), start)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        start = generation.now()
        body = await _json(request)
        eng = state.require_engine()
        req = parse_chat(body, state.model_name, eng.config.max_model_len)
        _prepare_chat(state, req)
        return await _generate(state, request, eng, req, Body("chat", state.model_name), start)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        """vLLM's: ``{"prompt": str}`` or ``{"messages": [...], "add_generation_prompt":
        true}`` (``add_special_tokens``) -> ``{"count", "max_model_len", "tokens"}``."""
        eng = state.require_engine()
        return tokenize_body(eng, await _json(request), state.model_name, state.chat)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        """vLLM's: ``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        return detokenize_body(state.require_engine(), await _json(request), state.model_name)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Any:
        """OpenAI's Responses API, stateless, run as a chat completion
        (``serve/responses_api.py``)."""
        start = generation.now()
        body = await _json(request)
        eng = state.require_engine()
        try:
            req = parse_chat(to_chat(body), state.model_name, eng.config.max_model_len)
            _prepare_chat(state, req)
            await generation.compile_constraint(eng, req)
            handles = generation.submit(eng, req)
        except APIError as e:
            raise rename(e) from None
        out, chat = ResponseObject(body, state.model_name), Body("chat", state.model_name)
        if req.stream:
            chunks = generation.stream(chat, req, handles, state.text, state.metrics, start)
            return StreamingResponse(
                events(out, chunks), media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                background=BackgroundTask(generation.abort_unfinished, handles),
            )  # fmt: skip
        whole = await generation.complete(chat, req, handles, state.text, state.metrics,
                                          request.is_disconnected, start)  # fmt: skip
        return out.from_chat(whole)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> dict[str, Any]:
        """OpenAI's embeddings: pooled final hidden states (``serve/embeddings.py``)."""
        body = await _json(request)
        if state.embedder is not None:
            return await embeddings_body(state.embedder, body, state.model_name, pooling)
        eng = state.require_engine()
        return await embeddings_body(eng, body, state.model_name, pooling or "last")

    return app


class _Gate:
    """Checks the API key on ``/v1`` paths and counts responses by endpoint and status."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = [500]

        async def send_counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            keys = self.state.api_keys
            if keys and path.startswith("/v1") and not _authorized(scope, keys):
                err = APIError("invalid or missing API key (Authorization: Bearer ...)",
                               status=401, code="invalid_api_key")  # fmt: skip
                await JSONResponse(err.body(), status_code=401)(scope, receive, send_counted)
            else:
                await self.app(scope, receive, send_counted)
        finally:
            endpoint = path if path in _ENDPOINTS else "other"
            self.state.metrics.http.labels(endpoint, str(status[0])).inc()


def _authorized(scope: Scope, keys: tuple[str, ...]) -> bool:
    auth = Headers(scope=scope).get("authorization", "")
    scheme, _, token = auth.partition(" ")
    token = token.strip()
    # every key compared (no early exit): the time does not tell which one came close
    ok = [hmac.compare_digest(token, k) for k in keys]
    return scheme.lower() == "bearer" and any(ok)


async def _json(request: Request) -> Any:
    try:
        raw = await request.body()
    except ClientDisconnect:  # gone before its body arrived: nothing was submitted
        raise APIError("the client disconnected", status=499) from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # thousands of nested levels: json.loads recurses per level
        raise APIError("the request body nests too deeply to parse") from None


def _prepare_chat(state: ServerState, req: GenerationRequest) -> None:
    """Render the chat prompt (tools included) into token ids, and choose how its choices
    are parsed: the tool parser when tools are rendered (``auto``), the forced-call
    reader for ``required`` / a named function (after the grammar hook), the reasoning
    parser when the server has one."""
    renderer, chat = state.chat, req.chat
    assert renderer is not None and chat is not None  # set with the engine; parse_chat
    prompt, ids = renderer.render_ids(chat)
    req.inputs = [ids]
    spec = chat.tools
    parser = None
    if spec is not None and spec.rendered:
        if spec.choice in ("required", "function"):
            forced = "required" if spec.function is None else {
                "type": "function", "function": {"name": spec.function}}  # fmt: skip
            constrain_to_tool_call(
                req.sampling, tool_call_schema(spec.tools, forced, spec.parallel)
            )
            parser = ForcedToolParser()
        else:
            parser = renderer.parser_for(chat.template)
            if parser is not None and parser.needs_special_tokens:
                # its markers are special tokens ([TOOL_CALLS], <|python_tag|>): the
                # text must keep them for the parser to see the call (vLLM does so too)
                req.sampling["skip_special_tokens"] = False
    if parser is not None or renderer.reasoning is not None:
        max_calls = spec.max_calls if spec is not None else None
        req.output = OutputSpec(parser, renderer.reasoning, prompt, max_calls)


async def _generate(
    state: ServerState,
    request: Request,
    engine: Engine,
    req: GenerationRequest,
    resp: Body,
    start: float,
) -> Any:
    await generation.compile_constraint(engine, req)
    handles = generation.submit(engine, req)
    if req.stream:
        events = generation.stream(resp, req, handles, state.text, state.metrics, start)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            # a safety net: a stream closed before its first event still aborts
            background=BackgroundTask(generation.abort_unfinished, handles),
        )
    return await generation.complete(
        resp, req, handles, state.text, state.metrics, request.is_disconnected, start
    )
