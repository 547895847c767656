"""``POST /v1/embeddings``: OpenAI's embeddings API on the served model.

``input``: a string, a list of strings, a list of token ids or a list of token-id lists
(one vector each, in order); ``encoding_format``: ``"float"`` (a list of numbers) or
``"base64"`` (the float32 little-endian bytes, base64: what the ``openai`` client asks
for by default and decodes); ``dimensions``: accepted only when it equals the model's
hidden size (the vectors are not truncated or projected); ``user``: accepted, unused.
The vectors are the model's final hidden states pooled per input (the server's
``--pooling``: ``last`` token, the default, or ``mean``) and L2-normalised
(``Engine.embed``); on a server of an embedding model (``--task embed``), its own
pooling unless ``--pooling`` is given (``EmbeddingModel.embed``).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import torch

from torch_topg.engine import Engine
from torch_topg.engine.embedding_model import EmbeddingModel
from torch_topg.engine.inputs import tokenize
from torch_topg.serve.errors import APIError, from_engine_error
from torch_topg.serve.protocol import check_fields, check_model

EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "dimensions", "user"})
MAX_INPUTS = 2048  # OpenAI's limit on the items of one request


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_input(value: Any) -> list[Any]:
    """The inputs of a request, one per vector; a 400 naming ``input`` when malformed."""

    def ids(x: Any) -> bool:
        return isinstance(x, list) and bool(x) and all(_int(t) for t in x)

    if isinstance(value, str) and value:
        return [value]
    if ids(value):
        return [value]
    if isinstance(value, list) and value and len(value) <= MAX_INPUTS:
        if all(isinstance(s, str) and s for s in value) or all(ids(x) for x in value):
            return list(value)
    raise APIError(
        "input must be a non-empty string, a list of them, a list of token ids or a list "
        f"of token-id lists (at most {MAX_INPUTS} items)",
        param="input",
    )


async def embeddings_body(
    engine: Engine | EmbeddingModel, body: Any, served: str, pooling: str | None
) -> dict[str, Any]:
    """The response of one embeddings request (the engine's work off the event loop)."""
    fields = check_fields(body, EMBEDDING_FIELDS)
    check_model(fields, served)
    if "input" not in fields:
        raise APIError("input is required", param="input")
    inputs = parse_input(fields["input"])
    fmt = fields.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise APIError(f"encoding_format must be 'float' or 'base64', got {fmt!r:.40}",
                       param="encoding_format")  # fmt: skip
    hidden = engine.model.config.get_text_config().hidden_size
    dims = fields.get("dimensions")
    if dims is not None and dims != hidden:
        raise APIError(
            f"dimensions must equal the model's hidden size ({hidden}) or be absent: the "
            f"vectors are not truncated or projected; got {dims!r:.40}",
            param="dimensions",
        )
    try:
        ids, vecs = await asyncio.to_thread(_embed, engine, inputs, pooling)
    except ValueError as e:
        raise from_engine_error(e, {"prompt": "input"}) from None
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(v, fmt)}
        for i, v in enumerate(vecs)
    ]
    tokens = sum(len(x) for x in ids)
    return {"object": "list", "data": data, "model": served,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip


def _embed(
    engine: Engine | EmbeddingModel, inputs: list[Any], pooling: str | None
) -> tuple[list[list[int]], Any]:
    """(token ids, vectors) of the inputs: tokenised once, here, then embedded."""
    vocab = engine.model.config.get_text_config().vocab_size
    ids = [tokenize(x, engine.tokenizer, vocab)[1] for x in inputs]
    return ids, engine.embed(ids, pooling=pooling)


def _encoded(v: torch.Tensor, fmt: str) -> list[float] | str:
    if fmt == "float":
        return v.tolist()
    return base64.b64encode(v.to(torch.float32).numpy().astype("<f4").tobytes()).decode()
