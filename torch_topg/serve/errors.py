"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

import re
from typing import Any


class APIError(Exception):
    """A request the server refuses; rendered as an OpenAI error body with ``status``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


# The engine's ValueErrors start with the parameter they name ("temperature must be ...",
# "prompt: 40 tokens, ..."); these are the names it uses and what the API calls them.
_ENGINE_NAME = re.compile(r"^([a-z_]+)(?::| must )")


def from_engine_error(err: ValueError, renames: dict[str, str]) -> APIError:
    """A 400 carrying the engine's message, ``param`` set to the API field it names.

    ``renames``: engine parameter -> the request's field (``max_new_tokens`` ->
    ``max_tokens``, ``prompt`` -> ``messages``); the message gets the API name too.
    """
    msg = str(err)
    m = _ENGINE_NAME.match(msg)
    param = None
    if m:
        name = m.group(1)
        param = renames.get(name, name)
        if param != name:
            msg = param + msg[len(name) :]
    return APIError(msg, param=param)
