"""The engine's typed errors: callers branch on the type and its fields, never on text."""

from __future__ import annotations


class ParameterError(ValueError):
    """A request parameter or engine option the engine refuses.

    ``param`` is the engine's own name for it (``temperature``, ``prompt``,
    ``max_batch_size``); the message names it first (``"param: ..."``, or the message as
    given when it already starts with the name: ``"top_p must be in (0, 1], got 2"``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message if message.startswith(param) else f"{param}: {message}")
        self.param = param


class EngineDeadError(RuntimeError):
    """``submit`` to an engine whose workers or nodes are lost (vLLM's name): the engine
    runs no more steps; its message says what was lost. ``shutdown()`` still works."""


class QueueFull(RuntimeError):
    """``submit`` found ``max_queue`` requests already waiting."""
