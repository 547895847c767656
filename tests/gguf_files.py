"""Writing tiny GGUF files in tests (gguf-py): the header every decoder file carries, the
shipped SmolLM2 file's tokenizer cut to the model's vocabulary (transformers' GGUF reader
needs one), and the close."""

from __future__ import annotations

import functools
from typing import Any

import gguf

from torch_topg.models.hf import gguf_path

#: ``quantization="gguf"`` with fp32 activations: the packed model computes the file's
#: de-quantised weights exactly (up to summation order), so tests compare it with the float
#: model holding them. The default (int8 activations, llama.cpp's rounding) is tested
#: against its own reference in tests/test_quant_gguf.py and tests/test_quant_linear.py.
GGUF_FP32_ACT = {"method": "gguf", "int8_activations": False}


@functools.cache
def _smollm2_tokenizer_fields() -> tuple[tuple, ...]:
    """The SmolLM2 file's tokenizer entries (read once: a GGUFReader over its 49,152-token
    vocabulary takes ~5 s)."""
    src = gguf.GGUFReader(str(gguf_path()))
    return tuple(
        (key, f.contents(), f.types[0], f.types[1] if len(f.types) > 1 else None)
        for key, f in src.fields.items()
        if key.startswith("tokenizer.")
    )


def tokenizer_fields(vocab_size: int) -> list[tuple]:
    """SmolLM2's tokenizer cut to its first ``vocab_size`` tokens (the merges kept are those
    whose parts and result are among them), so that the file's vocabulary is the model's.
    The whole one (49,152 tokens, 48,900 merges) made every GGUFReader and every
    transformers reading of a tiny test file parse ~150k strings: 3-5 s each."""
    fields = _smollm2_tokenizer_fields()
    kept = set(next(v for k, v, _, _ in fields if k == "tokenizer.ggml.tokens")[:vocab_size])
    out = []
    for key, value, kind, sub in fields:
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            value = value[:vocab_size]
        elif key == "tokenizer.ggml.merges":
            value = [m for m in value if m.replace(" ", "") in kept and set(m.split(" ")) <= kept]
        out.append((key, value, kind, sub))
    return out


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
    for key, value, kind, sub in tokenizer_fields(config.vocab_size):
        w.add_key_value(key, value, kind, sub_type=sub)
    return w


def close_file(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
