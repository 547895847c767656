"""Tool-call parsers: one module per output format, and the registry that picks one by
name (``--tool-call-parser``) or from the model (its chat template's markers, then its
``model_type``). Each parser reads a whole output (:meth:`ToolParser.parse`) or a stream
of text deltas (:meth:`ToolParser.stream`) into content and OpenAI-style calls."""

from __future__ import annotations

from torch_topg.serve.tool_parsers.base import (
    CallDelta,
    Parsed,
    ToolCall,
    ToolParser,
    ToolStream,
    new_call_id,
)
from torch_topg.serve.tool_parsers.hermes import HermesToolParser
from torch_topg.serve.tool_parsers.llama3_json import Llama3JsonToolParser
from torch_topg.serve.tool_parsers.mistral import MistralToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
}
# Other names for the same formats: Qwen2.5 / Qwen3 write Hermes' tags; SmolLM2's trained
# format is a JSON array inside the same tags (the Hermes parser reads arrays too).
ALIASES = {"qwen2_5": "hermes", "qwen3": "hermes", "smollm2": "hermes", "llama3": "llama3_json",
           "llama": "llama3_json"}  # fmt: skip
_BY_MODEL_TYPE = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes",
                  "qwen3_moe": "hermes", "mistral": "mistral", "mixtral": "mistral",
                  "llama": "llama3_json"}  # fmt: skip


def parser_names() -> list[str]:
    """Every name :func:`get_tool_parser` takes."""
    return sorted({*PARSERS, *ALIASES})


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name`` (a key of :data:`PARSERS` or an alias); ValueError
    listing the names otherwise."""
    key = ALIASES.get(name, name)
    if key not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(parser_names())}")
    return PARSERS[key]()


def detect_tool_parser(template: str | None, model_type: str | None = None) -> ToolParser:
    """The parser for a model whose tools are rendered by ``template``: the format whose
    call marker the template writes (``<tool_call>``, ``[TOOL_CALLS]``,
    ``<|python_tag|>`` or Llama 3's headers with ``parameters``), else by ``model_type``,
    else Hermes (the most common format)."""
    t = template or ""
    if "<tool_call>" in t:
        return HermesToolParser()
    if "[TOOL_CALLS]" in t:
        return MistralToolParser()
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and '"parameters"' in t):
        return Llama3JsonToolParser()
    if model_type == "llama" and "<|start_header_id|>" not in t:
        return HermesToolParser()  # Llama-architecture models on ChatML (SmolLM2, ...)
    return get_tool_parser(_BY_MODEL_TYPE.get(model_type or "", "hermes"))


__all__ = [
    "ALIASES", "PARSERS", "CallDelta", "Parsed", "ToolCall", "ToolParser", "ToolStream",
    "detect_tool_parser", "get_tool_parser", "new_call_id", "parser_names",
]  # fmt: skip
