"""Helpers shared by the offload tests: tiny models, bounded runs, quiet offload."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import torch_topg
from torch_topg.models import build_model

TOKENS = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))


def tiny(preset: str = "llama-tiny", layers: int = 6, **kw: Any) -> nn.Module:
    return build_model(preset, num_hidden_layers=layers, **kw)


def logits(model: nn.Module, x: torch.Tensor = TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(x).logits


def quiet_offload(model: nn.Module, **kw: Any) -> torch_topg.OffloadHandle:
    """offload() without the "source='cpu' on the CPU only adds copies" warning."""
    kw.setdefault("device", "cpu")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="offload: source='cpu'")
        return torch_topg.offload(model, **kw)


def eventually(cond: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``cond`` until it holds (True) or ``timeout`` seconds pass (False): for
    effects of the background reader, which land when its copy completes."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def bounded(fn: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Run ``fn`` on a thread; fail (instead of hanging the suite) if it does not return
    within ``timeout`` seconds; re-raise what it raised."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"did not finish within {timeout} s (hang)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Scripted(nn.Module):
    """Blocks called in a fixed, arbitrary sequence (repeats, skips, reversed order)."""

    def __init__(self, n: int, sequence: list[int], dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.head = nn.Linear(dim, dim)
        self.sequence = sequence

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.sequence:
            x = self.blocks[i](x)
        return self.head(x)
