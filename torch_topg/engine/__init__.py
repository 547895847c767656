"""The torch_topg inference engine: ``Engine.from_pretrained(...)``, continuous batching
on a paged KV cache, streaming, per-request sampling. See ``docs/engine.md``."""

from __future__ import annotations

from torch_topg.engine.engine import Engine, QueueFull
from torch_topg.engine.outputs import (
    CompletionOutput,
    Delta,
    RequestHandle,
    RequestOutput,
    TokenLogprob,
)
from torch_topg.engine.sampling import SamplingParams

__all__ = [
    "CompletionOutput",
    "Delta",
    "Engine",
    "QueueFull",
    "RequestHandle",
    "RequestOutput",
    "SamplingParams",
    "TokenLogprob",
]
