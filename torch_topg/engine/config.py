"""Engine options, resolved once in ``from_pretrained``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class EngineConfig:
    device: torch.device
    dtype: torch.dtype
    tp_size: int = 1
    prefetch_depth: int = 0
    max_batch_size: int = 16
    batch_timeout: float = 0.0  # ms
    max_num_batched_tokens: int = 512
    max_queue: int | None = None
    block_size: int = 16
    max_model_len: int = 2048
    num_blocks: int = 0
    seed: int | None = None
    deterministic: bool = False
    compile: bool = True
    decode_plan: bool = True  # decode batches as one native call (decode_plan.py)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "int8" (with scales)
    # the KV cache hierarchy (kv_cache.py)
    prefix_caching: bool = True
    host_kv_blocks: int = 0
    disk_kv_path: str | None = None
    disk_kv_blocks: int = 0
    session_ttl: float = 600.0
    session_kv_share: float = 0.5
    # speculative decoding (engine/speculative): a SpeculativeConfig, None: off
    speculative: Any = None


def available_memory(device: torch.device) -> int:
    """Bytes free for the KV pool: MemAvailable on the CPU, free device memory on CUDA."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_budget(
    spec: int | str | None,
    device: torch.device,
    wanted: int,
    name: str = "kv_cache_memory",
) -> int:
    """Bytes for a KV pool. ``spec``: bytes, ``"40%"`` of the available memory, or
    None: ``wanted`` (every sequence slot at full length) capped at 40% of it."""
    if spec is None:
        return min(wanted, int(0.4 * available_memory(device)))
    if isinstance(spec, str):
        s = spec.strip()
        if not s.endswith("%"):
            raise ValueError(f"{name}: expected bytes or a percentage like '40%', got {spec!r}")
        try:
            frac = float(s[:-1]) / 100
        except ValueError:
            raise ValueError(f"{name}: not a percentage: {spec!r}") from None
        if not 0 < frac <= 0.95:
            raise ValueError(f"{name}: expected a percentage in (0, 95], got {spec!r}")
        return int(frac * available_memory(device))
    if isinstance(spec, bool) or not isinstance(spec, int) or spec <= 0:
        raise ValueError(f"{name}: expected a positive byte count, got {spec!r}")
    return spec
