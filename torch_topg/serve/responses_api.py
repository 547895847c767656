"""``POST /v1/responses``: OpenAI's Responses API, stateless, on the chat path.

A body is translated into a chat completion request and runs as one (the chat template,
tool calling, structured outputs, sampling, streaming, disconnects): ``instructions``
becomes a system message; ``input`` (a string, or a list of items: messages with text
parts, ``function_call`` and ``function_call_output`` items) becomes the messages;
``tools`` (flat function tools) and ``tool_choice`` take the chat's shape;
``text.format`` (``json_schema`` / ``json_object`` / ``text``) becomes
``response_format``; ``max_output_tokens`` is ``max_tokens``. The chat answer is turned
back into a ``response`` object (a ``message`` item with ``output_text``, one
``function_call`` item per call) or, streamed, into the Responses API's events.

Stateless: nothing is stored, so ``previous_response_id`` and ``store: true`` are a 400
(send the whole conversation in ``input``). ``store`` absent or false is accepted.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from torch_topg.serve.errors import APIError
from torch_topg.serve.protocol import check_fields

_STATELESS = (
    "this server is stateless: responses are not stored; send the whole conversation in input"
)
RESPONSES_FIELDS = frozenset({
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools",
    "tool_choice", "parallel_tool_calls", "text", "stream", "store", "user", "seed",
})  # fmt: skip
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


def to_chat(body: Any) -> dict[str, Any]:
    """The chat completion body of a Responses request; a 400 naming the field (the
    Responses API's name) when it is malformed or needs server-side state."""
    if isinstance(body, dict):
        if body.get("previous_response_id") is not None:
            raise APIError(f"previous_response_id: {_STATELESS}", param="previous_response_id")
        if body.get("store") is True:
            raise APIError(f"store: {_STATELESS}", param="store")
    fields = check_fields(body, RESPONSES_FIELDS)
    if "input" not in fields:
        raise APIError("input is required", param="input")
    messages = []
    if "instructions" in fields:
        if not isinstance(fields["instructions"], str):
            raise APIError("instructions must be a string", param="instructions")
        messages.append({"role": "system", "content": fields["instructions"]})
    messages += _messages(fields["input"])
    chat: dict[str, Any] = {"messages": messages}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "stream", "user", "seed"):
        if name in fields:
            chat[name] = fields[name]
    if "max_output_tokens" in fields:
        chat["max_tokens"] = fields["max_output_tokens"]
    if "tools" in fields:
        chat["tools"] = _tools(fields["tools"])
    if "tool_choice" in fields:
        choice = fields["tool_choice"]
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        chat["tool_choice"] = choice
    if "text" in fields:
        chat["response_format"] = _text_format(fields["text"])
    if chat.get("stream"):
        chat["stream_options"] = {"include_usage": True}
    return chat


def _messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError("input must be a string or a non-empty list of items", param="input")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"{where} must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise APIError(f"{where}.role must be one of {', '.join(_ROLES)}",
                               param=f"{where}.role")  # fmt: skip
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _str(item, "call_id", where), "type": "function",
                    "function": {"name": _str(item, "name", where),
                                 "arguments": _str(item, "arguments", where)}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _str(item, "call_id", where),
                        "content": _str(item, "output", where)})  # fmt: skip
        else:
            raise APIError(f"{where}.type {kind!r:.40} is not supported (message, "
                           "function_call, function_call_output)", param=f"{where}.type")  # fmt: skip
    return out


def _str(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise APIError(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return v


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
                raise APIError(f"{where}[{j}]: only text parts are supported (input_text)",
                               param=f"{where}[{j}]")  # fmt: skip
            if not isinstance(part.get("text"), str):
                raise APIError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(f"{where} must be a string or a list of text parts", param=where)


def _tools(tools: Any) -> list[dict[str, Any]]:
    """Responses' flat function tools -> chat's ``{"type", "function": {...}}``."""
    if not isinstance(tools, list):
        raise APIError("tools must be a list of function tools", param="tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise APIError(f"tools[{i}]: only function tools are supported",
                           param=f"tools[{i}].type")  # fmt: skip
        fn = {k: v for k, v in t.items() if k != "type" and v is not None}
        out.append({"type": "function", "function": fn})
    return out


def _text_format(text: Any) -> dict[str, Any]:
    """``text: {"format": ...}`` -> chat's ``response_format``."""
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise APIError('text must be {"format": {...}}', param="text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    if kind in ("json_object", "text"):
        return {"type": kind}
    raise APIError(f"text.format.type must be text, json_object or json_schema, got "
                   f"{kind!r:.40}", param="text.format.type")  # fmt: skip


def rename(err: APIError) -> APIError:
    """A 400 of the chat path, named by the Responses API's field."""
    p = err.param or ""
    for chat, resp in (("response_format.json_schema", "text.format"),
                       ("response_format", "text.format"), ("max_tokens", "max_output_tokens"),
                       ("messages", "input")):  # fmt: skip
        if p.startswith(chat):
            err.param = resp + p[len(chat) :]
            err.message = err.message.replace(chat, resp, 1)
            break
    return err


class ResponseObject:
    """A response being built: its id, its output items, its final object."""

    def __init__(self, body: dict[str, Any], model: str) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.body, self.model = body, model
        self.output: list[dict[str, Any]] = []

    def obj(self, status: str, usage: dict[str, Any] | None = None,
            incomplete: str | None = None) -> dict[str, Any]:  # fmt: skip
        b = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": self.output,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": b.get("instructions"), "metadata": {},
            "max_output_tokens": b.get("max_output_tokens"),
            "temperature": b.get("temperature", 1.0), "top_p": b.get("top_p", 1.0),
            "tools": b.get("tools") or [], "tool_choice": b.get("tool_choice", "auto"),
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "text": b.get("text") or {"format": {"type": "text"}},
            "store": False, "usage": _usage(usage) if usage else None,
        }  # fmt: skip

    def from_chat(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The whole response of a (non-streamed) chat completion body."""
        choice = chat["choices"][0]
        msg = choice["message"]
        if msg.get("content"):
            self.output.append(_message_item(msg["content"], "completed"))
        for call in msg.get("tool_calls") or []:
            fn = call["function"]
            self.output.append(_call_item(call["id"], fn["name"], fn["arguments"], "completed"))
        incomplete = "max_output_tokens" if choice["finish_reason"] == "length" else None
        status = "incomplete" if incomplete else "completed"
        return self.obj(status, chat["usage"], incomplete)


def _usage(u: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
        "total_tokens": u["total_tokens"],
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens_details": {"reasoning_tokens": 0},
    }  # fmt: skip


def _message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}  # fmt: skip


def _call_item(
    call_id: str, name: str, args: str, status: str, item_id: str = ""
) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}",
            "call_id": call_id, "name": name, "arguments": args, "status": status}  # fmt: skip


async def events(resp: ResponseObject, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The Responses API's stream from the chat path's SSE chunks: ``response.created``,
    per output item ``response.output_item.added``, its deltas
    (``response.output_text.delta`` / ``response.function_call_arguments.delta``), their
    ``.done`` events and ``response.output_item.done``, then ``response.completed`` (or
    ``response.incomplete`` at ``max_output_tokens``, ``error`` when the engine failed)."""
    s = _Stream(resp)
    yield s.event("response.created", response=resp.obj("in_progress"))
    yield s.event("response.in_progress", response=resp.obj("in_progress"))
    usage, reason = None, None
    async for raw in chunks:
        if not raw.startswith("data: {"):
            continue  # [DONE]
        chunk = json.loads(raw[6:])
        if "error" in chunk:
            for e in s.close():
                yield e
            yield s.event("error", message=chunk["error"]["message"], code=chunk["error"]["code"],
                          param=chunk["error"]["param"])  # fmt: skip
            return
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            for e in s.delta(choice["delta"]):
                yield e
            reason = choice.get("finish_reason") or reason
    for e in s.close():
        yield e
    incomplete = "max_output_tokens" if reason == "length" else None
    kind = "response.incomplete" if incomplete else "response.completed"
    status = "incomplete" if incomplete else "completed"
    yield s.event(kind, response=resp.obj(status, usage, incomplete))


class _Stream:
    """The open output item of a stream and the events that open, feed and close it."""

    def __init__(self, resp: ResponseObject) -> None:
        self.resp = resp
        self.seq = 0
        self.item: dict[str, Any] | None = None  # the open item
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool_calls index -> item

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _open(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.item = item
        self.resp.output.append(item)
        out.append(self.event("response.output_item.added",
                              output_index=len(self.resp.output) - 1, item=item))  # fmt: skip
        if item["type"] == "message":
            out.append(self.event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.resp.output) - 1, content_index=0,
                                  part={"type": "output_text", "text": "", "annotations": []}))  # fmt: skip
        return out

    def delta(self, delta: dict[str, Any]) -> list[str]:
        out: list[str] = []
        index = len(self.resp.output) - 1
        if delta.get("content"):
            if self.item is None or self.item["type"] != "message":
                out += self._open(_message_item("", "in_progress"))
                index = len(self.resp.output) - 1
            assert self.item is not None
            self.item["content"][0]["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", item_id=self.item["id"],
                                  output_index=index, content_index=0, delta=delta["content"]))  # fmt: skip
        for tc in delta.get("tool_calls") or []:
            fn = tc.get("function") or {}
            if tc["index"] not in self.calls:
                item = _call_item(tc.get("id", ""), fn.get("name", ""), "", "in_progress")
                self.calls[tc["index"]] = item
                out += self._open(item)
                index = len(self.resp.output) - 1
            item = self.calls[tc["index"]]
            if fn.get("arguments"):
                item["arguments"] += fn["arguments"]
                out.append(self.event("response.function_call_arguments.delta",
                                      item_id=item["id"], output_index=index,
                                      delta=fn["arguments"]))  # fmt: skip
        return out

    def close(self) -> list[str]:
        """Close the open item: its ``.done`` events."""
        item, self.item = self.item, None
        if item is None:
            return []
        index = self.resp.output.index(item)
        item["status"] = "completed"
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            out.append(self.event("response.output_text.done", item_id=item["id"],
                                  output_index=index, content_index=0, text=part["text"]))  # fmt: skip
            out.append(self.event("response.content_part.done", item_id=item["id"],
                                  output_index=index, content_index=0, part=part))  # fmt: skip
        else:
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, arguments=item["arguments"]))  # fmt: skip
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out
