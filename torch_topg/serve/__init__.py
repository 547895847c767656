"""An OpenAI-compatible HTTP server on :class:`torch_topg.Engine` (FastAPI + uvicorn,
the ``serve`` extra). ``python -m torch_topg serve`` runs it; :func:`create_app` builds
the app over an engine you hold. See ``docs/serve.md``.

Importing ``torch_topg`` does not import this package (nor fastapi)."""

from __future__ import annotations

from torch_topg.serve.app import ServerState, create_app
from torch_topg.serve.errors import APIError

__all__ = ["APIError", "ServerState", "create_app"]
