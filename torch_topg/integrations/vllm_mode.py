"""The vLLM plugin's switch (``TOPG_VLLM_PLUGIN``) and its once-per-reason fallback log.

Shared by :mod:`~torch_topg.integrations.vllm_plugin` (the entry point) and the layer
classes in ``_vllm_layers.py``, which the entry point imports: neither imports the other
for these. Imports nothing of vLLM.
"""

from __future__ import annotations

import logging
import os

ENV_VAR = "TOPG_VLLM_PLUGIN"
_MODES = {"1": "on", "": "on", "on": "on", "0": "off", "off": "off", "all": "all"}

LOGGER = logging.getLogger("vllm.torch_topg")

_logged: set[tuple[str, str]] = set()


def mode() -> str:
    """``"on"``, ``"off"`` or ``"all"`` from ``TOPG_VLLM_PLUGIN`` (read on every call)."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"{ENV_VAR}={raw!r}: expected 1 (default), 0 or all")
    return _MODES[raw]


def log_fallback(layer: str, reason: str) -> None:
    """One log line per (layer class, reason): this call runs vLLM's implementation."""
    key = (layer, reason)
    if key in _logged:
        return
    _logged.add(key)
    LOGGER.info("torch_topg: %s runs vLLM's implementation: %s", layer, reason)
