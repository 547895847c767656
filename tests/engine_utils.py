"""Helpers of the engine tests: tiny engines, transformers' greedy reference, pool checks."""

from __future__ import annotations

import contextlib
import copy
import time

import torch

from torch_topg.engine import Engine
from torch_topg.models import build_model


def tiny(preset: str, **kw):
    """A seeded tiny transformers model of ``preset`` (Gemma 2 needs eager attention)."""
    attn = "eager" if preset.startswith("gemma") else "sdpa"
    return build_model(preset, attn_implementation=attn, **kw)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers ``generate``: ``n`` greedy tokens, EOS not stopping (as the engine's
    ``ignore_eos``; ``min_new_tokens`` would instead mask EOS out), DynamicCache."""
    ids = torch.tensor([prompt])
    gc = copy.deepcopy(model.generation_config)
    gc.eos_token_id, gc.pad_token_id, gc.do_sample = model.config.vocab_size + 1, 0, False
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), generation_config=gc, max_new_tokens=n
        )
    return out[0, len(prompt) :].tolist()


def wait_idle(engine: Engine, timeout: float = 30.0) -> None:
    """Wait until the engine's loop has nothing left (requests end asynchronously)."""
    deadline = time.monotonic() + timeout
    while engine.scheduler.has_work() or engine._inbox or engine._requests:
        if time.monotonic() > deadline:
            raise TimeoutError("engine still busy")
        time.sleep(0.01)


@contextlib.contextmanager
def whole_pool(engine: Engine):
    """After the block: no request left and every KV block back in the pool."""
    yield engine
    wait_idle(engine)
    engine.pool.check_whole()


def prompts(seed: int, lengths: list[int], vocab: int = 256) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
