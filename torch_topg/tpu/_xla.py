"""The ``XLA`` dispatch-key kernels of the ops that have a Pallas kernel.

``register_xla()`` registers, for each op in :data:`PALLAS_OPS`, a Python kernel at the
``XLA`` key. On a call it runs the op's argument checks, then asks :func:`probe` (once
per process; injectable with :func:`set_probe`) whether Pallas can run: torch_xla and
JAX importable and the XLA device a TPU. If so, and the call's arguments are covered
(``_pallas.unsupported``), the kernel runs through the backend (torch_xla custom call;
injectable with :func:`set_backend`); otherwise the reference runs, with one
``RuntimeWarning`` per op naming the reason. The other ops keep the reference fallback
registered at ``CompositeExplicitAutograd`` (``ops/_library.py``).
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from torch_topg.ops import OPS, _library
from torch_topg.tpu import _pallas

#: The ops with a Pallas kernel (a function of the same name in ``_pallas``). Their
#: argument check and reference come from the op registry (``torch_topg.ops.OPS``): the
#: same check the fake kernel and the fallback run.
PALLAS_OPS: tuple[str, ...] = (
    "rms_norm",
    "fused_add_rms_norm",
    "attention",
    "paged_attention",
    "moe_topk",
    "fused_moe",
)


@dataclass(frozen=True)
class Probe:
    """Whether the Pallas kernels can run on this XLA device; ``reason`` says why not."""

    pallas: bool
    reason: str = ""


def default_probe() -> Probe:
    """torch_xla importable, its PJRT device a TPU, JAX with Pallas importable."""
    try:
        import torch_xla.runtime as xr
    except ImportError as exc:
        return Probe(False, f"torch_xla is not importable ({exc})")
    device = xr.device_type()
    if device != "TPU":
        return Probe(False, f"the XLA device is {device} (PJRT_DEVICE), not a TPU")
    try:
        # Before JAX is imported: otherwise JAX claims the TPU and torch_xla hangs.
        from torch_xla.experimental.custom_kernel import jax_import_guard

        jax_import_guard()
        import jax.experimental.pallas  # noqa: F401
    except ImportError as exc:
        return Probe(
            False, f"JAX with Pallas is not importable ({exc}); pip install torch_topg[tpu]"
        )
    return Probe(True)


_lock = threading.Lock()
_state: dict[str, Any] = {"probe_fn": default_probe, "probe": None, "backend": None}
_warned: set[str] = set()
_registered: list[bool] = [False]


def probe() -> Probe:
    """The (cached) TPU decision."""
    if _state["probe"] is None:
        with _lock:
            if _state["probe"] is None:
                _state["probe"] = _state["probe_fn"]()
    return _state["probe"]


def set_probe(fn: Callable[[], Probe] | None) -> None:
    """Replace the TPU probe (``None``: the default); clears the cached decision and the
    warnings already given, so a test sees the first-call behaviour again."""
    with _lock:
        _state["probe_fn"] = fn or default_probe
        _state["probe"] = None
        _warned.clear()


def set_backend(backend: Any) -> None:
    """Replace how Pallas kernels run (``None``: torch_xla), e.g. with
    ``_bridge.InterpretBackend()`` to run the XLA kernels' glue on CPU tensors."""
    _state["backend"] = backend


def _backend() -> Any:
    if _state["backend"] is None:
        from torch_topg.tpu._bridge import XlaBackend

        _state["backend"] = XlaBackend()
    return _state["backend"]


def _warn_once(op: str, reason: str) -> None:
    with _lock:
        if op in _warned:
            return
        _warned.add(op)
        _library.FALLBACKS_USED.add((op, "xla"))
    warnings.warn(
        f"topg::{op} on an XLA device runs the pure-PyTorch reference: {reason}",
        RuntimeWarning,
        stacklevel=3,
    )


def _to(x: Any, device: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(a, device) for a in x)
    return x


def _reference(op: str, ref: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run a reference for the XLA kernel: on the host for XLA tensors, results moved
    back (in-place arguments copied back). The kernel runs below torch_xla's Functionalize
    key, where the references' writes through views (``out[b] = ...``) are lost on raw
    XLA tensors, and their data-dependent ``tolist()`` would sync anyway: this path is
    for correctness on an XLA device without a TPU, not speed."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None or device.type != "xla":
        return ref(*args, **kwargs)
    host_args, host_kwargs = _to(args, "cpu"), _to(kwargs, "cpu")
    out = ref(*host_args, **host_kwargs)
    written = OPS[op].mutated_args
    for i, name in enumerate(OPS[op].arg_names[: len(args)]):
        if name in written and args[i] is not None:
            args[i].copy_(host_args[i].to(device))
    return _to(out, device)


def xla_kernel(op: str) -> Callable[..., Any]:
    """The Python kernel registered for ``topg::<op>`` at the ``XLA`` key."""
    spec = OPS[op]
    check, ref = spec.check, spec.reference
    impl = getattr(_pallas, op)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        decision = probe()
        reason = (
            decision.reason if not decision.pallas else _pallas.unsupported(op, *args, **kwargs)
        )
        if not reason:
            return impl(_backend(), *args, **kwargs)
        _warn_once(op, reason)
        return _reference(op, ref, args, kwargs)

    kernel.__name__ = f"{op}_xla"
    return kernel


def register_xla() -> None:
    """Register the XLA-key kernels (idempotent; imports neither JAX nor torch_xla)."""
    with _lock:
        if _registered[0]:
            return
        _registered[0] = True
    for op in PALLAS_OPS:
        _library.LIB.impl(op, xla_kernel(op), "XLA")
