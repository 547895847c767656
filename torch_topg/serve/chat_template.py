"""Chat prompts rendered by the server: the model's Jinja chat template (as transformers
renders it, ``apply_chat_template`` with ``tools=``), a template given with
``--chat-template`` (a file or a shipped name) or, per request, ``chat_template`` (a
shipped name) and ``chat_template_kwargs`` (extra template variables).

Shipped templates (``torch_topg/serve/templates/``): ``hermes`` (ChatML,
``<tool_call>`` JSON), ``smollm2`` (SmolLM2's ChatML, a JSON list inside
``<tool_call>``), ``llama3_json`` (Llama 3.x headers, ``{"name", "parameters"}``) and
``mistral`` (``[AVAILABLE_TOOLS]`` / ``[TOOL_CALLS]`` / ``[TOOL_RESULTS]``).

Whether a template renders tools is found by rendering it with a probe tool and looking
for the probe's name. A request with tools (or tool turns in its history) uses the
model's template when it does; else a ChatML template falls back to ``smollm2`` (the
template of SmolLM2, which renders none) or ``hermes`` (another ChatML model); another
template has no fallback, and such a request is refused naming ``tools``.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch_topg.serve.errors import APIError
from torch_topg.serve.reasoning import ReasoningParser, get_reasoning_parser
from torch_topg.serve.tool_parsers import ToolParser, detect_tool_parser, get_tool_parser
from torch_topg.serve.tools import ToolSpec

log = logging.getLogger("torch_topg.serve")

TEMPLATES = Path(__file__).parent / "templates"
SHIPPED = ("hermes", "llama3_json", "mistral", "smollm2")
_PROBE = "topg_probe_function"
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE, "description": "probe", "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
# variables the renderer sets itself: not overridable through chat_template_kwargs
_RESERVED = {"messages", "tools", "documents", "add_generation_prompt", "chat_template",
             "continue_final_message", "tokenize", "bos_token", "eos_token"}  # fmt: skip


@functools.cache
def shipped_template(name: str) -> str:
    """The text of a shipped template (one of :data:`SHIPPED`)."""
    if name not in SHIPPED:
        raise ValueError(f"no shipped chat template {name!r}; shipped: {', '.join(SHIPPED)}")
    return (TEMPLATES / f"{name}.jinja").read_text()


def load_chat_template(arg: str) -> str:
    """``--chat-template``'s value: a shipped template's name, or a Jinja file's path
    (ValueError when it is neither)."""
    if arg in SHIPPED:
        return shipped_template(arg)
    try:
        return Path(arg).read_text()
    except OSError as e:
        raise ValueError(f"--chat-template {arg!r}: neither a shipped template "
                         f"({', '.join(SHIPPED)}) nor a readable file ({e})") from None  # fmt: skip


def renders_tools(tokenizer: Any, template: str | None) -> bool:
    """Whether ``template`` (None: the tokenizer's own) writes the tools it is given."""
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], tools=_PROBE_TOOLS, chat_template=template,
            add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
    except Exception:
        return False
    return isinstance(text, str) and _PROBE in text


def tools_fallback(template: str | None) -> str | None:
    """The shipped template to render tools with when ``template`` cannot: SmolLM2's
    own format for its ChatML template, Hermes' for another ChatML one, else None."""
    if not template or "<|im_start|>" not in template:
        return None
    return "smollm2" if "SmolLM" in template else "hermes"


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat options (``--chat-template``, ``--tool-call-parser``,
    ``--reasoning-parser``): the template's text (None: the model's own) and the
    parsers' names (None: the tool parser detected from the model, no reasoning split)."""

    template: str | None = None
    tool_parser: str | None = None
    reasoning_parser: str | None = None


@dataclass
class ChatInput:
    """A checked chat request: messages (OpenAI's, tool turns included), its tools, and
    the per-request template choice and variables."""

    messages: list[dict[str, Any]]
    tools: ToolSpec | None = None
    template: str | None = None  # a shipped template's name
    template_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def has_tool_turns(self) -> bool:
        return any(m.get("tool_calls") or m["role"] == "tool" for m in self.messages)


def check_template_fields(fields: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """``chat_template`` (a shipped template's name) and ``chat_template_kwargs`` (an
    object of template variables, none of those the renderer sets) of a body."""
    name = fields.get("chat_template")
    if name is not None and name not in SHIPPED:
        raise APIError(f"chat_template must name a shipped template ({', '.join(SHIPPED)}); "
                       "a server takes another with --chat-template", param="chat_template")  # fmt: skip
    kwargs = fields.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise APIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
    for key in kwargs:
        if key in _RESERVED or key in _apply_parameters():
            raise APIError(f"chat_template_kwargs.{key} is set by the server, not the request",
                           param=f"chat_template_kwargs.{key}")  # fmt: skip
    return name, dict(kwargs)


@functools.cache
def _apply_parameters() -> frozenset[str]:
    try:
        from transformers import PreTrainedTokenizerBase

        return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    except Exception:  # transformers missing or changed: the fixed list still applies
        return frozenset()


class ChatRenderer:
    """Renders chat requests for one tokenizer and picks the output parsers.

    ``template``: the ``--chat-template`` text (None: the tokenizer's own);
    ``tool_parser`` / ``reasoning_parser``: names given on the command line (None: the
    tool parser is detected from the template that renders the tools, and no reasoning
    is split out); ``model_type``: the model config's, a hint for the detection."""

    def __init__(
        self,
        tokenizer: Any,
        template: str | None = None,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
        model_type: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template = template
        base = template if template is not None else getattr(tokenizer, "chat_template", None)
        self.base = base if isinstance(base, str) else None
        self.model_type = model_type
        self._forced_parser = get_tool_parser(tool_parser) if tool_parser else None
        self.reasoning: ReasoningParser | None = (
            get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        )
        if tokenizer is not None and renders_tools(tokenizer, template):
            self.tools_template: str | None = template  # None with renders: the tokenizer's
            self.tools_template_name = "model" if template is None else "--chat-template"
            self._tools_ok = True
        else:
            name = tools_fallback(self.base)
            self.tools_template = shipped_template(name) if name else None
            self.tools_template_name = name or "none"
            self._tools_ok = name is not None
            if name:
                log.info("the chat template renders no tools: tools use the shipped %r", name)
        self.tool_parser = self.parser_for(None)

    def parser_for(self, template_name: str | None) -> ToolParser:
        """The tool parser for a request (``template_name``: its ``chat_template``)."""
        if self._forced_parser is not None:
            return self._forced_parser
        text = shipped_template(template_name) if template_name else self._tools_text()
        return detect_tool_parser(text, self.model_type)

    def _tools_text(self) -> str | None:
        return self.tools_template if self.tools_template is not None else self.base

    def render(self, chat: ChatInput, add_generation_prompt: bool = True) -> str:
        """The prompt text of ``chat``; 400s name ``tools`` (no template renders them)
        or ``messages`` (the template refused the conversation)."""
        tok = self.tokenizer
        if tok is None:
            raise APIError("this model has no tokenizer", param="messages")
        use_tools = chat.tools is not None and chat.tools.rendered
        template = self.template
        if chat.template is not None:
            template = shipped_template(chat.template)
        elif use_tools or chat.has_tool_turns:
            if not self._tools_ok:
                raise APIError(
                    "this model's chat template renders no tools and has no fallback; start "
                    f"the server with --chat-template (a file, or one of {', '.join(SHIPPED)}) "
                    "or send chat_template",
                    param="tools" if use_tools else "messages",
                )
            template = self.tools_template
        elif template is None and not getattr(tok, "chat_template", None):
            raise APIError("this model has no chat template", param="messages")
        try:
            return tok.apply_chat_template(
                _for_template(chat.messages),
                tools=chat.tools.tools if use_tools else None,  # type: ignore[union-attr]
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **chat.template_kwargs,
            )
        except Exception as e:  # the template's own checks (roles must alternate, ...)
            raise APIError(f"the chat template could not render messages: {e}",
                           param="messages") from None  # fmt: skip

    def render_ids(self, chat: ChatInput) -> tuple[str, list[int]]:
        """``(prompt text, token ids)``, as the engine tokenizes chat prompts."""
        text = self.render(chat)
        return text, [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]


def _for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as templates expect them: a call's ``arguments`` as an object
    (templates serialise it themselves) where the JSON text is one."""
    import json

    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c["function"])
                try:
                    args = json.loads(fn["arguments"])
                except (TypeError, ValueError):
                    args = None
                if isinstance(args, dict):
                    fn["arguments"] = args
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out
