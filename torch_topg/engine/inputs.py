"""The engine's inputs: prompts to token ids, the new-token limit of a request, the
list of prompts ``generate`` takes, and the ids that end a sample."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

import torch

from torch_topg.engine.block_pool import BlockPool
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.sampling_params import SamplingParams


def tokenize(input: Any, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """``(text or None, token ids)`` of one prompt: a string, chat messages (the chat
    template with a generation prompt), token ids (checked against ``vocab_size``) or a
    1-D tensor of them."""
    if isinstance(input, str):
        if not input:
            raise ParameterError("prompt", "empty string")
        if tokenizer is None:
            raise ParameterError("prompt", "a string needs a tokenizer; this engine has none")
        return input, list(tokenizer.encode(input, add_special_tokens=True))
    if isinstance(input, (list, tuple)) and input and all(isinstance(m, dict) for m in input):
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ParameterError("prompt", "chat messages need a tokenizer with a chat template")
        text = tokenizer.apply_chat_template(
            list(input), add_generation_prompt=True, tokenize=False
        )
        ids = tokenizer.encode(text, add_special_tokens=False)
        return text, list(ids)
    if isinstance(input, (list, tuple)) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in input
    ):
        if not input:
            raise ParameterError("prompt", "empty token id list")
        bad = [t for t in input if not 0 <= t < vocab_size]
        if bad:
            raise ParameterError("prompt", f"token ids outside [0, {vocab_size}): {bad[:8]}")
        return None, list(input)
    if isinstance(input, torch.Tensor) and input.dim() == 1:
        return tokenize(input.tolist(), tokenizer, vocab_size)
    raise ParameterError(
        "prompt",
        "expected a string, a list of token ids, or chat messages "
        f"(a list of {{'role', 'content'}} dicts), got {type(input).__name__}",
    )


def new_token_limit(p: SamplingParams, prompt_len: int, max_model_len: int, pool: BlockPool) -> int:
    """The most new tokens a request of ``prompt_len`` may get: its ``max_new_tokens`` /
    ``max_length``, the context and vLLM's default of 16; refused when it could never fit
    the KV pool (``n`` samples)."""
    limit = max_model_len
    if prompt_len >= limit:
        raise ParameterError(
            "prompt",
            f"{prompt_len} tokens, the context is {limit} (max_model_len); "
            "leave room for at least one new token",
        )
    n = limit - prompt_len
    if p.max_new_tokens is not None:
        n = min(n, p.max_new_tokens)
    if p.max_length is not None:
        if p.max_length <= prompt_len:
            raise ParameterError(
                "max_length",
                f"{p.max_length} leaves no room after the {prompt_len}-token prompt",
            )
        n = min(n, p.max_length - prompt_len)
    if p.max_new_tokens is None and p.max_length is None:
        n = min(n, 16)  # vLLM's default max_tokens
    need = pool.blocks_for(prompt_len + n) * p.n
    if need > pool.num_blocks:
        raise ParameterError(
            "prompt",
            f"{p.n} x {prompt_len + n} tokens need {need} KV blocks, the pool "
            f"has {pool.num_blocks} (raise kv_cache_memory or lower max_new_tokens)",
        )
    return n


def split_inputs(inputs: Any) -> list[Any]:
    """``generate``'s inputs as a list of single prompts."""
    if isinstance(inputs, (str, torch.Tensor)):
        return [inputs]
    if isinstance(inputs, Seq) and inputs:
        first = inputs[0]
        if isinstance(first, dict):  # one conversation
            return [inputs]
        if isinstance(first, int) and not isinstance(first, bool):  # one token id list
            return [inputs]
        return list(inputs)
    raise ParameterError(
        "inputs", f"expected a prompt or a non-empty list of prompts, got {inputs!r}"
    )


def eos_ids(model: torch.nn.Module, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen = getattr(model, "generation_config", None)
    for src in (getattr(gen, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(x) for x in src)
    return frozenset(ids)
