"""What the replicas of the cluster tests build, importable in Ray's worker processes
(the tests put this folder on their PYTHONPATH): the tiny chat engine of the server
tests, with KV events on, and its tokenizer."""

from __future__ import annotations

from typing import Any


def tiny_chat_engine() -> Any:
    from test_serve import chat_engine

    return chat_engine(kv_events=True)


def tiny_tokenizer() -> tuple[Any, int]:
    from test_serve import byte_tokenizer

    tok = byte_tokenizer()
    return tok, len(tok)
