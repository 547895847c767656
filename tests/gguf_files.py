"""Writing tiny GGUF files in tests (gguf-py): the header every decoder file carries, the
shipped SmolLM2 file's tokenizer (transformers' GGUF reader needs one), and the close."""

from __future__ import annotations

import functools
from typing import Any

import gguf

from torch_topg.models.hf import gguf_path


@functools.cache
def tokenizer_fields() -> list[tuple]:
    """The SmolLM2 file's tokenizer entries (read once: a GGUFReader over its 49,152-token
    vocabulary takes ~5 s)."""
    src = gguf.GGUFReader(str(gguf_path()))
    return [
        (key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
        for key, f in src.fields.items()
        if key.startswith("tokenizer.")
    ]


def open_file(path: Any, arch: str, config: Any) -> gguf.GGUFWriter:
    """A writer for ``path`` with ``config``'s decoder sizes and the tokenizer; the caller
    adds the architecture's own keys and the tensors, then calls :func:`close_file`."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    for key, value, kind, sub in tokenizer_fields():
        w.add_key_value(key, value, kind, sub_type=sub)
    return w


def close_file(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
