"""What the replicas of the cluster tests build, importable in Ray's worker processes
(the tests put this folder on their PYTHONPATH): the tiny chat engine of the server
tests, with KV events on, and its tokenizer; and what the pipeline tests share: a free
loopback port and their tiny Llama."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_pp_llama(folder: Path) -> Path:
    """A tiny Llama (no tokenizer), 3 layers, 6 query / 3 KV heads, untied LM head, saved
    in ``folder``: the pipeline tests' model."""
    from torch_topg.models import build_model

    build_model(
        "llama-tiny", hidden_size=96, num_attention_heads=6, num_key_value_heads=3,
        num_hidden_layers=3, tie_word_embeddings=False,
    ).save_pretrained(folder)  # fmt: skip
    return folder


def tiny_chat_engine() -> Any:
    from test_serve import chat_engine

    return chat_engine(kv_events=True)


def tiny_tokenizer() -> tuple[Any, int]:
    from test_serve import byte_tokenizer

    tok = byte_tokenizer()
    return tok, len(tok)
