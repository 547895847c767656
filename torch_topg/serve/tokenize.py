"""``POST /tokenize`` and ``POST /detokenize``, as vLLM's server answers them.

``/tokenize`` takes ``{"prompt": str}`` (``add_special_tokens``, default true) or
``{"messages": [...]}`` (rendered with the chat template the chat endpoint uses;
``add_generation_prompt``, default true) and answers ``{"count", "max_model_len",
"tokens"}``; ``/detokenize`` takes ``{"tokens": [ids]}`` and answers ``{"prompt": text}``.
The ``model`` field is accepted and, as elsewhere, must name the served model.
"""

from __future__ import annotations

from typing import Any

from torch_topg.engine import Engine
from torch_topg.serve.chat_template import ChatInput, ChatRenderer, check_template_fields
from torch_topg.serve.errors import APIError
from torch_topg.serve.protocol import chat_messages, check_fields, check_model
from torch_topg.serve.tools import parse_tools

TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "tools",
     "chat_template", "chat_template_kwargs"}
)  # fmt: skip
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _tokenizer(engine: Engine) -> Any:
    if engine.tokenizer is None:
        raise APIError("this model has no tokenizer", status=400)
    return engine.tokenizer


def _flag(fields: dict[str, Any], name: str) -> bool:
    v = fields.get(name, True)
    if not isinstance(v, bool):
        raise APIError(f"{name} must be a bool, got {v!r:.40}", param=name)
    return v


def tokenize_body(
    engine: Engine, body: Any, served: str, renderer: ChatRenderer | None = None
) -> dict[str, Any]:
    """``renderer``: the chat endpoint's (so both count the same tokens); None: one over
    the engine's tokenizer with the model's template."""
    fields = check_fields(body, TOKENIZE_FIELDS)
    check_model(fields, served)
    tok = _tokenizer(engine)
    if ("prompt" in fields) == ("messages" in fields):
        raise APIError("give exactly one of prompt and messages", param="prompt")
    if "prompt" in fields:
        prompt = fields["prompt"]
        if not isinstance(prompt, str):
            raise APIError(f"prompt must be a string, got {prompt!r:.40}", param="prompt")
        ids = tok.encode(prompt, add_special_tokens=_flag(fields, "add_special_tokens"))
    else:
        template, kwargs = check_template_fields(fields)
        chat = ChatInput(chat_messages(fields["messages"]), parse_tools(fields), template, kwargs)
        renderer = renderer or ChatRenderer(tok)
        text = renderer.render(chat, add_generation_prompt=_flag(fields, "add_generation_prompt"))
        ids = tok.encode(text, add_special_tokens=False)
    ids = [int(t) for t in ids]
    return {"count": len(ids), "max_model_len": engine.config.max_model_len, "tokens": ids}


def detokenize_body(engine: Engine, body: Any, served: str) -> dict[str, Any]:
    fields = check_fields(body, DETOKENIZE_FIELDS)
    check_model(fields, served)
    tok = _tokenizer(engine)
    ids = fields.get("tokens")
    vocab = len(tok)
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
    ):
        raise APIError(f"tokens must be a list of token ids in [0, {vocab})", param="tokens")
    return {"prompt": tok.decode(ids)}
