"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions``, checked and turned
into engine inputs and sampling keywords.

Every field of a body is either accepted (and used), or refused with a 400 naming it:
OpenAI fields the server does not implement get a reason (``UNSUPPORTED``), anything
else is an unknown field. A field whose value is ``null`` counts as absent (OpenAI's
meaning of null: the default). Values the engine checks itself (temperature, top_p, ...)
are passed through and its ``ValueError`` comes back as the 400's message.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from torch_topg.serve.chat_template import ChatInput, check_template_fields
from torch_topg.serve.constraints import FIELDS as STRUCTURED_FIELDS
from torch_topg.serve.constraints import parse_structured
from torch_topg.serve.errors import APIError
from torch_topg.serve.tools import parse_tools

# Accepted by both endpoints: OpenAI's sampling fields plus vLLM's extensions (top_k,
# min_p, repetition_penalty, ignore_eos, stop_token_ids, min_tokens, skip_special_tokens,
# priority), with the engine's meanings (``Engine.submit``'s keywords).
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "logit_bias",
    "min_tokens",
    "skip_special_tokens",  # vLLM's (default true); the Mistral tool parser turns it off
    "priority",  # vLLM's: lower first, with --scheduling-policy priority
)
_COMMON = {
    "model", "stream", "stream_options", "max_tokens", "logprobs", "user", "session_id",
    "prompt_logprobs",
    *_SAMPLING, *STRUCTURED_FIELDS,
}  # fmt: skip
MAX_SESSION_ID = 256  # characters
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "echo"})
CHAT_FIELDS = frozenset(_COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
    "parallel_tool_calls", "chat_template", "chat_template_kwargs",
})  # fmt: skip

_FUNCTIONS = "the deprecated functions API is not implemented; use tools and tool_choice"
UNSUPPORTED: dict[str, str] = {
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "best_of": "best_of (ranking several samples) is not implemented; use n",
    "suffix": "fill-in-the-middle (suffix) is not implemented",
    "audio": "audio output is not implemented (text models only)",
    "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "reasoning controls are not implemented",
    "service_tier": "service tiers do not exist on this server",
    "store": "stored completions are not implemented",
    "metadata": "stored completions (metadata) are not implemented",
    "web_search_options": "web search is not implemented",
    "verbosity": "verbosity controls are not implemented",
}

_ROLES = ("system", "user", "assistant", "tool")
# the keys a message may have, by role (OpenAI's; ``name`` is passed to the template)
_MESSAGE_KEYS = {
    "system": ("role", "content", "name"),
    "user": ("role", "content", "name"),
    "assistant": ("role", "content", "name", "tool_calls"),
    "tool": ("role", "content", "tool_call_id"),
}
MAX_TOP_LOGPROBS = 20  # the engine's MAX_LOGPROBS


@dataclass
class GenerationRequest:
    """A checked request: one engine input per prompt, the same sampling for each."""

    inputs: list[Any]
    sampling: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs
    n: int = 1
    # engine parameter -> this request's field, for the engine's error messages
    renames: dict[str, str] = field(default_factory=dict)
    session_id: str | None = None  # the engine's session (KV kept for the conversation)
    chat: ChatInput | None = None  # chat: what the server renders into ``inputs``
    output: Any = None  # chat: how choices are parsed (app.OutputSpec), None: plain text
    echo: bool = False  # completions: the prompt's text (and logprobs) before each choice's
    prompt_logprobs: int | None = None  # vLLM's: alternatives per prompt token; None: none


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _present(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


def check_fields(body: Any, accepted: frozenset[str]) -> dict[str, Any]:
    """The body's non-null fields; a 400 naming the first unsupported or unknown one."""
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, got {type(body).__name__}")
    fields = _present(body)
    for name in sorted(fields):
        if name in accepted:
            continue
        if name in UNSUPPORTED:
            raise APIError(
                f"{name} is not supported by this server: {UNSUPPORTED[name]}", param=name
            )
        raise APIError(
            f"unknown field {name!r}; accepted: {', '.join(sorted(accepted))}", param=name
        )
    return fields


def check_model(fields: dict[str, Any], served: str) -> None:
    model = fields.get("model")
    if model is not None and model != served:
        raise APIError(
            f"model {model!r} is not served here; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def _max_tokens(fields: dict[str, Any], names: tuple[str, ...]) -> tuple[int | None, str]:
    """The tightest of the given max-token fields (each an int >= 1) and its name."""
    best: tuple[int | None, str] = (None, names[0])
    for name in names:
        v = fields.get(name)
        if v is None:
            continue
        if not _is_int(v) or v < 1:
            raise APIError(f"{name} must be an int >= 1, got {v!r}", param=name)
        if best[0] is None or v < best[0]:
            best = (v, name)
    return best


def _stream_options(fields: dict[str, Any]) -> tuple[bool, bool]:
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(f"stream must be a bool, got {stream!r}", param="stream")
    opts = fields.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise APIError("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(opts, dict):
        raise APIError(f"stream_options must be an object, got {opts!r}", param="stream_options")
    for key in opts:
        if key != "include_usage":
            raise APIError(
                f"stream_options.{key} is not supported (only include_usage)",
                param=f"stream_options.{key}",
            )
    usage = opts.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError(
            f"stream_options.include_usage must be a bool, got {usage!r}",
            param="stream_options.include_usage",
        )
    return stream, usage


def _sampling(fields: dict[str, Any], renames: dict[str, str]) -> dict[str, Any]:
    """The engine's sampling keywords; a structured-output constraint's field goes into
    ``renames`` (the engine's errors about it name that field)."""
    out = {k: fields[k] for k in _SAMPLING if k in fields}
    if out.get("logit_bias") is not None:
        out["logit_bias"] = _logit_bias(out["logit_bias"])
    spec, where = parse_structured(fields)
    if spec is not None:
        out["structured"] = spec
        renames["structured"] = where or "structured"
    return out


def _logit_bias(bias: Any) -> dict[int, Any]:
    """OpenAI's ``logit_bias``: token ids (JSON object keys, so strings) -> bias; the
    values are checked by the engine (numbers in [-100, 100])."""
    if not isinstance(bias, dict):
        raise APIError(f"logit_bias must be an object, got {bias!r:.80}", param="logit_bias")
    out = {}
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isdigit()):
            raise APIError(f"logit_bias keys must be token ids, got {k!r:.40}", param="logit_bias")
        out[int(k)] = v
    return out


def parse_completion(body: Any, served: str) -> GenerationRequest:
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of
    token ids or a list of such lists (one request each)."""
    fields = check_fields(body, COMPLETION_FIELDS)
    check_model(fields, served)
    if "prompt" not in fields:
        raise APIError("prompt is required", param="prompt")
    inputs = _prompts(fields["prompt"])
    stream, usage = _stream_options(fields)
    renames = {"prompt": "prompt"}
    sampling = _sampling(fields, renames)
    max_tokens, name = _max_tokens(fields, ("max_tokens",))
    sampling["max_new_tokens"] = max_tokens if max_tokens is not None else 16  # OpenAI's
    lp = fields.get("logprobs")
    if lp is not None and (not _is_int(lp) or not 0 <= lp <= MAX_TOP_LOGPROBS):
        raise APIError(
            f"logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {lp!r}", param="logprobs"
        )
    if lp is not None:
        sampling["logprobs"] = lp
    echo = fields.get("echo", False)
    if not isinstance(echo, bool):
        raise APIError(f"echo must be a bool, got {echo!r:.40}", param="echo")
    plp = _prompt_logprobs(fields, sampling)
    if echo and lp is not None:  # the echoed prompt's tokens carry logprobs too
        sampling["prompt_logprobs"] = max(lp, plp or 0)
    return GenerationRequest(
        inputs, sampling, stream, usage, lp, _n(fields),
        renames={"max_new_tokens": name, **renames},
        session_id=_session_id(fields), echo=echo, prompt_logprobs=plp,
    )  # fmt: skip


def _prompt_logprobs(fields: dict[str, Any], sampling: dict[str, Any]) -> int | None:
    """vLLM's ``prompt_logprobs``: an int in [0, 20] (alternatives per prompt token)."""
    plp = fields.get("prompt_logprobs")
    if plp is None:
        return None
    if not _is_int(plp) or not 0 <= plp <= MAX_TOP_LOGPROBS:
        raise APIError(
            f"prompt_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {plp!r:.40}",
            param="prompt_logprobs",
        )
    sampling["prompt_logprobs"] = plp
    return plp


def _prompts(prompt: Any) -> list[Any]:
    def token_ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(_is_int(t) for t in x)

    if isinstance(prompt, str):
        return [prompt]
    if token_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt) or all(token_ids(p) for p in prompt):
            return list(prompt)
    raise APIError(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists (non-empty)",
        param="prompt",
    )


def parse_chat(body: Any, served: str, max_model_len: int) -> GenerationRequest:
    """``POST /v1/chat/completions``: text messages, rendered by the tokenizer's chat
    template with a generation prompt. Without max_tokens the answer may use the rest
    of the context (OpenAI's default for chat)."""
    fields = check_fields(body, CHAT_FIELDS)
    check_model(fields, served)
    if "messages" not in fields:
        raise APIError("messages is required", param="messages")
    messages = chat_messages(fields["messages"])
    template, template_kwargs = check_template_fields(fields)
    chat = ChatInput(messages, parse_tools(fields), template, template_kwargs)
    stream, usage = _stream_options(fields)
    renames: dict[str, str] = {}
    sampling = _sampling(fields, renames)
    max_tokens, name = _max_tokens(fields, ("max_completion_tokens", "max_tokens"))
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    else:
        sampling["max_length"] = max_model_len
    lp = fields.get("logprobs", False)
    if not isinstance(lp, bool):
        raise APIError(f"logprobs must be a bool, got {lp!r}", param="logprobs")
    top = fields.get("top_logprobs")
    if top is not None:
        if not lp:
            raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
        if not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise APIError(
                f"top_logprobs must be an int in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                param="top_logprobs",
            )
    k = (top or 0) if lp else None
    if k is not None:
        sampling["logprobs"] = k
    return GenerationRequest(
        [messages], sampling, stream, usage, k, _n(fields),
        renames={"max_new_tokens": name, "prompt": "messages", "max_length": "messages",
                 "logprobs": "top_logprobs", **renames},
        session_id=_session_id(fields), chat=chat,
        prompt_logprobs=_chat_prompt_logprobs(fields, sampling, stream),
    )  # fmt: skip


def _chat_prompt_logprobs(fields: dict[str, Any], sampling: dict[str, Any], stream: bool) -> Any:
    """Chat's ``prompt_logprobs``: returned in the whole response only (vLLM's)."""
    if stream and fields.get("prompt_logprobs") is not None:
        raise APIError("prompt_logprobs is returned with stream=false only on chat "
                       "completions", param="prompt_logprobs")  # fmt: skip
    return _prompt_logprobs(fields, sampling)


def _session_id(fields: dict[str, Any]) -> str | None:
    """``session_id`` (an extension): a non-empty string naming the conversation, so the
    engine keeps its KV blocks in preference to others' (not ``user``: OpenAI's ``user``
    names an end user, who may hold many conversations)."""
    sid = fields.get("session_id")
    if sid is None:
        return None
    if not isinstance(sid, str) or not 0 < len(sid) <= MAX_SESSION_ID:
        raise APIError(
            f"session_id must be a non-empty string of at most {MAX_SESSION_ID} characters, "
            f"got {sid!r:.80}",
            param="session_id",
        )
    return sid


def _n(fields: dict[str, Any]) -> int:
    n = fields.get("n", 1)
    return n if _is_int(n) else 1  # the engine names a bad n


def chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Chat messages checked: text content; the roles system, user, assistant (with
    ``tool_calls``, whose ``arguments`` are JSON text) and tool (with ``tool_call_id``).
    A 400 names the first bad field (``messages[i].tool_calls[j].function.name``, ...)."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where} must be an object", param=where)
        role = m.get("role")
        if role not in _ROLES:
            raise APIError(
                f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r:.40}",
                param=f"{where}.role",
            )
        fields = _present(m)
        for key in fields:
            if key not in _MESSAGE_KEYS[role]:
                raise APIError(
                    f"{where}.{key} is not supported in a {role} message "
                    f"(only {', '.join(_MESSAGE_KEYS[role])})",
                    param=f"{where}.{key}",
                )
        msg: dict[str, Any] = {"role": role}
        if role == "assistant" and "tool_calls" in fields:
            msg["tool_calls"] = _tool_calls(fields["tool_calls"], f"{where}.tool_calls")
            content = fields.get("content")
            msg["content"] = "" if content is None else _content(content, f"{where}.content")
        else:
            msg["content"] = _content(m.get("content"), f"{where}.content")
        if role == "tool":
            tid = fields.get("tool_call_id")
            if not isinstance(tid, str) or not tid:
                raise APIError(f"{where}.tool_call_id is required (the id of the call "
                               "this answers)", param=f"{where}.tool_call_id")  # fmt: skip
            msg["tool_call_id"] = tid
        if "name" in fields:
            if not isinstance(fields["name"], str):
                raise APIError(f"{where}.name must be a string", param=f"{where}.name")
            msg["name"] = fields["name"]
        out.append(msg)
    return out


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: ``{"id", "type": "function", "function":
    {"name", "arguments"}}`` each, ``arguments`` a string (JSON text)."""
    if not isinstance(calls, list) or not calls:
        raise APIError(f"{where} must be a non-empty list", param=where)
    out = []
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(c, dict):
            raise APIError(f"{at} must be an object", param=at)
        for key in c:
            if key not in ("id", "type", "function"):
                raise APIError(f"{at}.{key} is not a field of a tool call", param=f"{at}.{key}")
        if c.get("type", "function") != "function":
            raise APIError(f"{at}.type must be 'function'", param=f"{at}.type")
        cid = c.get("id")
        if cid is not None and not isinstance(cid, str):
            raise APIError(f"{at}.id must be a string", param=f"{at}.id")
        fn = c.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"{at}.function must be an object", param=f"{at}.function")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(f"{at}.function.name must be a non-empty string",
                           param=f"{at}.function.name")  # fmt: skip
        if not isinstance(fn.get("arguments"), str):
            raise APIError(f"{at}.function.arguments must be a string (JSON text)",
                           param=f"{at}.function.arguments")  # fmt: skip
        call = {"type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}
        if cid is not None:
            call["id"] = cid
        out.append(call)
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(
                    f"{where}[{j}]: only text parts are supported (text models), got {kind!r}",
                    param=f"{where}[{j}]",
                )
            if not isinstance(part.get("text"), str):
                raise APIError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(
        f"{where} must be a string or a list of text parts, got {content!r}", param=where
    )
