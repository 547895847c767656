"""torch_topg: fused LLM inference kernels for PyTorch.

``import torch_topg`` defines the ``topg`` operators (``torch.ops.topg.*``), loads the
native kernels if they were built, and exposes typed wrappers in ``torch_topg.ops``.
"""

from __future__ import annotations

from torch_topg import _native, ops, reference

__version__ = "0.1.0"

_native.load()

__all__ = ["__version__", "native_available", "ops", "reference"]


def native_available() -> bool:
    """True when the compiled kernels (``torch_topg/_C.so``) are loaded."""
    return _native.is_loaded()
