"""Helpers of the engine tests: tiny engines, transformers' greedy reference, pool checks."""

from __future__ import annotations

import contextlib
import copy
import random
import time
from typing import Any

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


class Seqs:
    """Sequences on a runner's paged cache with blocks handed out in a scattered order."""

    def __init__(self, runner: Any, toks: list[list[int]], seed: int = 0):
        self.r, self.toks = runner, [list(t) for t in toks]
        free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(free)
        self.free, self.blocks = free, [[] for _ in toks]

    def _grow(self, i: int, n: int) -> None:
        while len(self.blocks[i]) * self.r.block_size < n:
            self.blocks[i].append(self.free.pop())

    def prefill(self) -> None:
        items = []
        for i, t in enumerate(self.toks):
            self._grow(i, len(t))
            items.append((t, 0, len(t), self.blocks[i]))
        self.r.execute_graph(self.r.pack(items, [True] * len(items)))

    def decode_batch(self, nxt: list[int]):
        return self.ragged_batch([[x] for x in nxt], [1] * len(nxt))

    def ragged_batch(self, new: list[list[int]], samples: list[int]):
        """Each sequence computes its tokens ``new[i]`` (a verify step: k + 1 of them);
        its last ``samples[i]`` rows are sampled."""
        items = []
        for i, t in enumerate(self.toks):
            t.extend(new[i])
            self._grow(i, len(t))
            items.append((t, len(t) - len(new[i]), len(new[i]), self.blocks[i]))
        return self.r.pack(items, samples)
