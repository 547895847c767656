"""Prefetching weight offload: run a model whose layer weights live in host memory or
in memory-mapped safetensors, reading ``prefetch_depth`` layers ahead of compute.

See docs/offload.md. ``offload(model, ...)`` returns an :class:`OffloadHandle`.
"""

from __future__ import annotations

from torch_topg.offload.api import OffloadHandle, find_layers, offload
from torch_topg.offload.engine import FaultHooks

__all__ = ["FaultHooks", "OffloadHandle", "find_layers", "offload"]
