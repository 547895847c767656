"""The placeholders a pipeline stage puts where another stage's modules were
(parallel/pipeline.py), in a module of their own: the tensor-parallel loader (api.py)
recognises them, and pipeline.py uses that loader."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class SkippedLayer(nn.Module):
    """A decoder layer held by another stage: the hidden states pass through."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states

    def extra_repr(self) -> str:
        return f"layer {self.index} (another stage)"


class Removed(nn.Module):
    """A module held by another stage (an embedding or LM head); calling it is a bug."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError(f"pipeline: {self.what} belongs to another stage")
