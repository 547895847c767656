"""A decoder-only embedding model on its own: ``serve --model PATH --task embed``.

Qwen3-Embedding, gte-Qwen and E5-Mistral are causal decoders trained so that the last
token's final hidden state (L2-normalised) is the text's embedding. They need no KV
cache, no sampler and no LM head, so :class:`EmbeddingModel` is not an
:class:`~torch_topg.engine.Engine`: it loads the base model (``AutoModel``: the layers
and the final norm; a checkpoint saved with an LM head loads without it) and runs
:func:`torch_topg.engine.embed.embed`, the prompts packed side by side with the ragged
causal path of ``topg::attention``, as ``Engine.embed`` does for a generating model.

Which models are embedding models (:func:`is_embedding_model`, the server's
``--task auto``), decided as vLLM decides it for ``--runner auto``, from the files:

- a sentence-transformers folder (``modules.json`` lists a ``Pooling`` module, as
  Qwen3-Embedding's does): its pooling config gives the pooling (``lasttoken`` ->
  ``"last"``, ``mean_tokens`` -> ``"mean"``) and a ``Normalize`` module the
  normalisation;
- or a config whose ``architectures`` are all base models (``Qwen3Model``,
  ``LlamaModel``: no ``For...`` head).

Anything else is a generating model; ``--task embed`` (or vLLM's ``--runner pooling``)
forces the embedding path for any decoder (last-token pooling, normalised).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torch_topg.engine.embed import POOLINGS, embed
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.inputs import split_inputs, tokenize

# sentence-transformers' pooling flags -> ours (the first one set wins)
_ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}


@dataclass(frozen=True)
class PoolingConfig:
    """How a model's hidden states become one vector."""

    pooling: str = "last"
    normalize: bool = True


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def sentence_transformers_pooling(folder: Path) -> PoolingConfig | None:
    """The pooling of a sentence-transformers folder (None: not one, or no Pooling
    module). A pooling mode this module does not implement is a ``ValueError``."""
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = {str(m.get("type", "")).rsplit(".", 1)[-1]: m for m in modules if isinstance(m, dict)}
    if "Pooling" not in kinds:
        return None
    cfg = _read_json(folder / str(kinds["Pooling"].get("path", "")) / "config.json") or {}
    modes = [k for k, v in cfg.items() if k.startswith("pooling_mode") and v]
    pooling = next((_ST_POOLING[m] for m in modes if m in _ST_POOLING), None)
    if pooling is None:
        if modes:
            raise ValueError(
                f"{folder}: sentence-transformers pooling {modes} is not implemented "
                f"(only {sorted(_ST_POOLING)})"
            )
        pooling = "last"
    return PoolingConfig(pooling, "Normalize" in kinds)


def is_embedding_model(folder: Path) -> bool:
    """Whether ``folder`` holds an embedding model (see the module docstring)."""
    if sentence_transformers_pooling(folder) is not None:
        return True
    archs = (_read_json(folder / "config.json") or {}).get("architectures") or []
    return bool(archs) and all(a.endswith("Model") and "For" not in a for a in archs)


class EmbeddingModel:
    """A base decoder that embeds prompts (:meth:`embed`); thread-safe (one call at a
    time runs the model)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        max_model_len: int,
        max_batch_tokens: int,
        pooling: PoolingConfig | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_batch_tokens = max_batch_tokens
        self.pooling = pooling or PoolingConfig()
        self._lock = threading.Lock()

    @classmethod
    def from_pretrained(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        device: Any = None,
        dtype: Any = None,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
    ) -> EmbeddingModel:
        """Load a folder or a cached Hub id (as ``Engine.from_pretrained`` resolves it; a
        GGUF file is refused). ``dtype``: as the engine's (float32 on the CPU by default)."""
        from transformers import AutoModel

        from torch_topg.engine.attention import ATTN_IMPLEMENTATION, register_attention
        from torch_topg.engine.config import device_of, dtype_of
        from torch_topg.engine.loading import _config_tokenizer, resolve
        from torch_topg.engine.options import EngineArgs

        folder, gguf = resolve(model)
        if gguf:
            raise ParameterError("model", f"{gguf}: a GGUF file cannot be served as an "
                                 "embedding model; give its safetensors folder")  # fmt: skip
        args = EngineArgs(device=device, dtype=dtype, max_model_len=max_model_len,
                          max_num_batched_tokens=max_num_batched_tokens)  # fmt: skip
        dev = device_of(args)
        dt = dtype_of(args, dev)
        config, tok = _config_tokenizer(folder, None)
        register_attention()
        m = AutoModel.from_pretrained(folder, dtype=dt)
        m.set_attn_implementation(ATTN_IMPLEMENTATION)  # the packed, cache-less path
        m = m.to(dev).eval()
        text = config.get_text_config()
        limit = max_model_len or getattr(text, "max_position_embeddings", None) or 2048
        budget = max_num_batched_tokens or (2048 if dev.type == "cpu" else 8192)
        return cls(m, tok, max_model_len=limit, max_batch_tokens=budget,
                   pooling=sentence_transformers_pooling(folder))  # fmt: skip

    def embed(
        self, inputs: Any, *, pooling: str | None = None, normalize: bool | None = None
    ) -> torch.Tensor:
        """float32 ``[N, hidden]``: one vector per prompt (a string, token ids, or a list of
        them); ``pooling`` / ``normalize`` default to the model's (:class:`PoolingConfig`)."""
        pooling = pooling or self.pooling.pooling
        if pooling not in POOLINGS:
            raise ParameterError("pooling", f"expected one of {POOLINGS}, got {pooling!r}")
        normalize = self.pooling.normalize if normalize is None else normalize
        vocab = self.model.config.get_text_config().vocab_size
        ids = [tokenize(x, self.tokenizer, vocab)[1] for x in split_inputs(inputs)]
        for i, x in enumerate(ids):
            if len(x) > self.max_model_len:
                raise ParameterError(
                    "input", f"input {i}: {len(x)} tokens, the context is {self.max_model_len}"
                )
        with self._lock:
            return embed(self.model, ids, pooling=pooling, normalize=normalize,
                         max_batch_tokens=self.max_batch_tokens)  # fmt: skip

    def shutdown(self) -> None:
        """Nothing runs in the background: kept for the server's shutdown path."""
