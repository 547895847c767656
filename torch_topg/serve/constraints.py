"""Structured-output fields of a request body, in the dialects clients send, as the
engine's one :class:`~torch_topg.engine.structured.Structured` spec.

- OpenAI: ``response_format`` ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}``, ``{"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}``;
- vLLM: ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ...}`` and the older ``guided_json`` / ``guided_regex`` /
  ``guided_choice`` / ``guided_grammar``;
- llama.cpp: ``grammar`` (GBNF) and ``json_schema`` (a schema object).

At most one constraint a request: a second is a 400 naming it. A malformed value is a
400 naming its field (``response_format.json_schema.schema``, ``guided_regex``); whether
it compiles is the engine's check (:meth:`Engine.compile_structured`), reported against
the same field.
"""

from __future__ import annotations

from typing import Any

from torch_topg.engine.errors import ParameterError
from torch_topg.engine.structured import Structured
from torch_topg.serve.errors import APIError

FIELDS = (
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "grammar",
    "json_schema",
)
_GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "grammar": "grammar",
    "json_schema": "json_schema",
}
_VLLM = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def parse_structured(fields: dict[str, Any]) -> tuple[Structured | None, str | None]:
    """The request's constraint and the field it came from; ``(None, None)`` when it has
    none. Raises :class:`APIError` (400) naming the field at fault."""
    found: list[tuple[Structured, str]] = []
    for name in FIELDS:
        if name not in fields:
            continue
        got = _one(name, fields[name])
        if got is not None:
            found.append(got)
    if len(found) > 1:
        names = [f for _, f in found]
        raise APIError(
            f"only one structured-output constraint may be given, got {', '.join(names)}",
            param=names[1],
        )
    return found[0] if found else (None, None)


def _spec(kind: str, value: Any, where: str) -> tuple[Structured, str]:
    if kind == "json_schema" and isinstance(value, dict) and not value:
        kind, value = "json_object", None  # {} allows any JSON: take it as an object
    try:
        return Structured(kind, value), where
    except ParameterError as e:
        msg = str(e).removeprefix("structured: ")
        raise APIError(f"{where}: {msg}", param=where) from None


def _one(name: str, value: Any) -> tuple[Structured, str] | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _structured_outputs(value)
    return _spec(_GUIDED[name], value, name)


def _response_format(rf: Any) -> tuple[Structured, str] | None:
    if not isinstance(rf, dict):
        raise APIError(
            f"response_format must be an object, got {rf!r:.80}", param="response_format"
        )
    kind = rf.get("type")
    extra = sorted(set(rf) - {"type", "json_schema"})
    if extra:
        raise APIError(
            f"response_format.{extra[0]} is not supported", param=f"response_format.{extra[0]}"
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("json_object", None, "response_format")
    if kind != "json_schema":
        raise APIError(
            f"response_format.type must be text, json_object or json_schema, got {kind!r:.40}",
            param="response_format.type",
        )
    js = rf.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(js, dict):
        raise APIError(f"{where} must be an object with a schema", param=where)
    for key in js:
        if key not in ("name", "schema", "strict", "description"):
            raise APIError(f"{where}.{key} is not supported", param=f"{where}.{key}")
    if "name" in js and not isinstance(js["name"], str):
        raise APIError(f"{where}.name must be a string", param=f"{where}.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise APIError(f"{where}.strict must be a bool", param=f"{where}.strict")
    if js.get("schema") is None:
        raise APIError(f"{where}.schema is required", param=f"{where}.schema")
    return _spec("json_schema", js["schema"], f"{where}.schema")


def _structured_outputs(so: Any) -> tuple[Structured, str] | None:
    where = "structured_outputs"
    if not isinstance(so, dict):
        raise APIError(f"{where} must be an object, got {so!r:.80}", param=where)
    found = []
    for key, v in so.items():
        if v is None:
            continue
        if key == "json_object":
            if v is not True:
                raise APIError(f"{where}.json_object must be true", param=f"{where}.json_object")
            found.append(_spec("json_object", None, f"{where}.json_object"))
        elif key in _VLLM:
            found.append(_spec(_VLLM[key], v, f"{where}.{key}"))
        else:
            raise APIError(
                f"{where}.{key} is not supported (json, regex, choice, grammar, json_object)",
                param=f"{where}.{key}",
            )
    if len(found) > 1:
        raise APIError(
            f"{where}: only one of json, regex, choice, grammar, json_object may be given",
            param=found[1][1],
        )
    return found[0] if found else None
