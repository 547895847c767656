"""``torch_topg.enable()`` / ``disable()`` / ``enabled()``: topg under unchanged eager code.

While enabled:

1. **Dispatcher** (C++, no Python per call): the CPU kernels of
   ``aten::scaled_dot_product_attention``, ``aten::rms_norm`` and ``aten::linear`` are
   topg adapters (see :mod:`torch_topg.eager._dispatch`), so ``F.scaled_dot_product_attention``,
   ``F.rms_norm`` and ``nn.Linear`` in any eager code run topg where topg is faster and
   computes the same thing, and the original kernels otherwise.
2. **transformers**: the ``sdpa`` / ``eager`` attention and the ``eager`` / ``grouped_mm``
   / ``batched_mm`` experts entries point at topg, and recognised RMSNorm / attention
   module classes use fused topg ops (:mod:`torch_topg.eager.modules`). Models built
   before or after ``enable()`` are both covered.

Semantics: ``enable()`` is idempotent (enabling twice is the same as once) and one
``disable()`` turns everything off; ``disable()`` when not enabled does nothing;
``with enabled():`` enables for the block and restores the previous state on exit, so
it nests. A lock makes enable/disable thread-safe. ``disable()`` restores the exact
prior dispatch table, interface entries and class attributes.

Gradients: whenever grad mode is on and an input requires grad, every path runs the
original code (topg ops have no backward), so training is unaffected. Inference under
``torch.no_grad()`` / ``torch.inference_mode()`` (as ``generate`` does) runs topg.

Without the native extension (``TOPG_DISABLE_NATIVE=1`` or not built) the topg ops would
run their pure-PyTorch references, slower than stock PyTorch, so ``enable()`` then
changes nothing and warns once with the reason (also in :func:`status`).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections.abc import Iterator
from types import ModuleType

from torch_topg.eager import _dispatch, _import_hook, hf

_lock = threading.RLock()
_state: dict[str, object] = {"enabled": False, "intercepted": [], "warned": False}


def _on_transformers_import(name: str, module: ModuleType) -> None:
    hf.register()
    with _lock:
        if not _state["enabled"]:
            return
        hf.route_interfaces()
        if name.startswith("transformers.models."):
            from torch_topg.eager import modules

            modules.patch_module(module)


def install_transformers_hook() -> None:
    """Called by ``import torch_topg``: register ``topg`` now if transformers is
    imported, and after it is imported otherwise."""
    hf.register()
    _import_hook.install(_on_transformers_import)


def is_enabled() -> bool:
    return bool(_state["enabled"])


def enable() -> None:
    """Route eager PyTorch / transformers code through topg kernels (idempotent)."""
    with _lock:
        if _state["enabled"]:
            return
        reason = _dispatch.available()
        if reason is not None:
            if not _state["warned"]:
                _state["warned"] = True
                warnings.warn(
                    f"torch_topg.enable() does nothing: it {reason}", RuntimeWarning, stacklevel=2
                )
            return
        _state["intercepted"] = _dispatch.enable()
        hf.route_interfaces()
        if "transformers" in sys.modules:
            from torch_topg.eager import modules

            modules.patch_loaded()
        _state["enabled"] = True


def disable() -> None:
    """Undo :func:`enable` exactly; a no-op when not enabled."""
    with _lock:
        if not _state["enabled"]:
            return
        _dispatch.disable()
        hf.unroute_interfaces()
        mod = sys.modules.get("torch_topg.eager.modules")
        if mod is not None:
            mod.unpatch_all()
        _state["enabled"], _state["intercepted"] = False, []


@contextlib.contextmanager
def enabled() -> Iterator[None]:
    """``with torch_topg.enabled():`` enable for the block, then restore the prior state."""
    with _lock:
        was = is_enabled()
        enable()
    try:
        yield
    finally:
        if not was:
            disable()


def status() -> dict[str, object]:
    """What is routed right now: intercepted aten ops (per dispatch key), patched module
    classes, and why interception is unavailable (None when it is)."""
    mod = sys.modules.get("torch_topg.eager.modules")
    return {
        "enabled": is_enabled(),
        "intercepted": list(_state["intercepted"]),  # type: ignore[call-overload]
        "patched": mod.patched_classes() if mod is not None else [],
        "unavailable": _dispatch.available(),
    }


__all__ = ["disable", "enable", "enabled", "is_enabled", "status"]
