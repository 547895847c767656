"""torch_topg: fused LLM inference kernels for PyTorch.

``import torch_topg`` defines the ``topg`` operators (``torch.ops.topg.*``), loads the
native kernels if they were built, and exposes typed wrappers in ``torch_topg.ops``.
"""

from __future__ import annotations

from torch_topg import _native, ops, reference

__version__ = "0.1.0"

_native.load()
ops.dispatch.install()  # the CUDA keys of the dispatched ops, where topg has CUDA kernels

from torch_topg import tpu  # noqa: E402  (XLA-key kernels; imports no JAX / torch_xla)

tpu.register_xla()

from torch_topg import eager  # noqa: E402  (after load: enable() needs the native ops)
from torch_topg.eager import disable, enable, enabled  # noqa: E402
from torch_topg.modes import index_checks, set_index_checks  # noqa: E402
from torch_topg.offload import OffloadHandle, offload  # noqa: E402
from torch_topg.ops.dispatch import dispatch_report  # noqa: E402
from torch_topg.quant import quantize  # noqa: E402  (weight-only quantisation)

eager.install_transformers_hook()

__all__ = [
    "Engine",
    "OffloadHandle",
    "__version__",
    "disable",
    "dispatch_report",
    "eager",
    "enable",
    "enabled",
    "explain",
    "index_checks",
    "native_available",
    "offload",
    "ops",
    "quantize",
    "reference",
    "set_index_checks",
]


def __getattr__(name: str):  # type: ignore[no-untyped-def]
    # The engine is imported on first use: `import torch_topg` stays light.
    if name == "Engine":
        from torch_topg.engine import Engine

        return Engine
    raise AttributeError(f"module 'torch_topg' has no attribute {name!r}")


def native_available() -> bool:
    """True when the compiled kernels (``torch_topg/_C.so``) are loaded."""
    return _native.is_loaded()


def explain(model, *args, **kwargs):  # type: ignore[no-untyped-def]
    """What ``torch.compile(model, backend="topg")`` replaces; see
    :func:`torch_topg.compile.explain` (imported on first use: it loads the backend)."""
    from torch_topg.compile import explain as _explain

    return _explain(model, *args, **kwargs)
