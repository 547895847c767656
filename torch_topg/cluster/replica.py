"""One engine replica on Ray Serve: an :class:`~torch_topg.engine.Engine` and the server's
OpenAI app in one process, called by the router (:mod:`torch_topg.cluster.ingress`).

Each call of :meth:`EngineReplica.handle` streams back, in order:

- ``("head", replica, sent_from, next, events, info)``: the replica's id, the KV events
  the router has not seen yet (``sent_from``: the cursor the router sent in its
  :class:`Route`; msgpack bytes in vLLM's format) and what the router needs to hash
  prompts (the hashes' root, the block size, the context length);
- ``("http", message)``: the app's response (:func:`torch_topg.cluster.asgi.call_asgi`);
- ``("tail", replica, sent_from, next, events)``: the events the request itself caused
  (the prompt's blocks), so the next request with this prefix finds them.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from torch_topg.cluster.asgi import HTTPRequest, call_asgi
from torch_topg.engine import Engine
from torch_topg.engine.kv_events import encode


@dataclass
class Route:
    """What the router decides with, sent along with each call (Ray pickles it)."""

    hashes: list[bytes] = field(default_factory=list)  # the prompt's full blocks
    session: str | None = None
    cursors: dict[str, int] = field(default_factory=dict)  # next KV event per replica
    pin: str | None = None  # a call for one replica (metrics, info)
    replica: str | None = None  # set when routed (on the router's side)
    reason: str | None = None


@dataclass
class RouterOptions:
    """The ingress's settings (ingress.py; the thresholds: router.py)."""

    load_ratio: float = 2.0  # router.py: the thresholds
    load_floor: int = 4
    min_prefix_share: float = 0.5
    max_attempts: int = 3
    stall_timeout_s: float = 120.0
    tokenizer: Callable[[], Any] | None = None  # -> (tokenizer, vocab size); None: no prefix keys
    chat_template: str | None = None


@dataclass
class EngineSpec:
    """How a replica builds its engine and app: ``factory()`` (any picklable callable
    returning an Engine, e.g. for tests) or ``Engine.from_pretrained(model, **options)``;
    ``kv_events`` is turned on (the router needs them)."""

    model: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    factory: Callable[[], Engine] | None = None
    served_name: str = "model"
    app_options: dict[str, Any] = field(default_factory=dict)  # create_app's keywords
    threads: int | None = None  # torch threads of each replica


class EngineReplica:
    """The body of the ``engine`` deployment (wrapped by ``serve.deployment`` in deploy.py)."""

    def __init__(self, spec: EngineSpec) -> None:
        import torch

        from torch_topg.serve import create_app

        if spec.threads:
            torch.set_num_threads(spec.threads)
        if spec.factory is not None:
            self.engine = spec.factory()
        else:
            self.engine = Engine.from_pretrained(spec.model, **{**spec.options, "kv_events": True})
        if self.engine.kv.events is None:
            self.engine.shutdown()
            raise ValueError("EngineSpec.factory: the engine needs kv_events=True (the router reads them)")  # fmt: skip
        self.app = create_app(self.engine, spec.served_name, **spec.app_options)
        self.id = _replica_id()
        kv = self.engine.kv
        self.info = {
            "replica": self.id, "pid": os.getpid(), "root": kv.root,
            "block_size": kv.pool.block_size, "max_model_len": self.engine.config.max_model_len,
        }  # fmt: skip

    def _events(self, cursor: int) -> tuple[int, bytes]:
        log = self.engine.kv.events
        assert log is not None
        nxt, batch = log.since(cursor)
        return nxt, encode(batch)

    async def handle(self, req: HTTPRequest, route: Route | None = None) -> AsyncIterator[tuple]:
        sent = route.cursors.get(self.id, 0) if route is not None else 0
        nxt, events = self._events(sent)
        yield ("head", self.id, sent, nxt, events, self.info)
        async for m in call_asgi(self.app, req):
            yield ("http", m)
        after, events = self._events(nxt)
        yield ("tail", self.id, nxt, after, events)

    async def metrics(self, route: Route | None = None) -> bytes:
        return self.app.state.topg.metrics.render()

    async def describe(self, route: Route | None = None) -> dict[str, Any]:
        return {**self.info, "stats": self.engine.stats()["requests"]}

    def check_health(self) -> None:
        """Serve's health check: the engine loop must be running."""
        if not self.engine._thread.is_alive():
            raise RuntimeError("the engine loop has stopped")

    def __del__(self) -> None:
        eng = getattr(self, "engine", None)
        if eng is not None:
            eng.shutdown()


def _replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests of the class itself)
        return f"pid-{os.getpid()}"
