"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status."""

from __future__ import annotations

from typing import Any

from torch_topg.engine.errors import ParameterError


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
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers or {}
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


def from_engine_error(err: ValueError, renames: dict[str, str]) -> APIError:
    """A 400 carrying the engine's message, ``param`` set to the API field it names.

    A :class:`~torch_topg.engine.errors.ParameterError` names its parameter; ``renames``
    maps engine names to the request's fields (``max_new_tokens`` -> ``max_tokens``,
    ``prompt`` -> ``messages``), and the message's leading name becomes the API's too.
    Another ``ValueError`` is a 400 without ``param``.
    """
    msg = str(err)
    if not isinstance(err, ParameterError):
        return APIError(msg, param=None)
    name = err.param
    param = renames.get(name, name)
    if param != name and msg.startswith(name):
        msg = param + msg[len(name) :]
    return APIError(msg, param=param)
