"""The ``topg`` library object: defines every schema and registers the Python-side kernels.

Per op this module registers two things against the schema from ``_schemas.py``:

* a fake (meta) kernel, so the op works under ``torch.compile`` and ``FakeTensor``;
* the pure-PyTorch reference at ``CompositeExplicitAutograd``: the fallback for any
  device without a native kernel (or when the native extension is not loaded). It runs
  the same argument checks as the native kernels and warns once per (op, device).

Native kernels registered for ``CPU`` / ``CUDA`` take precedence over the fallback.
Each registration is also recorded in the op registry (``_registry.OPS``), which is what
other modules read.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from torch_topg.ops._registry import OpSpec, add
from torch_topg.ops._schemas import INTERNAL_SCHEMAS, SCHEMAS

LIB = torch.library.Library("topg", "DEF")
for _schema in [*SCHEMAS.values(), *INTERNAL_SCHEMAS.values()]:
    LIB.define(_schema)

_fallback_lock = threading.Lock()
#: (op name, device type) pairs that ran through the reference fallback.
FALLBACKS_USED: set[tuple[str, str]] = set()


def _first_device(args: tuple[Any, ...]) -> str:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a.device.type
    return "cpu"


def _note_fallback(name: str, device: str) -> None:
    key = (name, device)
    if key in FALLBACKS_USED:
        return
    with _fallback_lock:
        if key in FALLBACKS_USED:
            return
        FALLBACKS_USED.add(key)
    from torch_topg import _native

    reason = _native.missing_reason(device)
    warnings.warn(
        f"topg::{name} has no native kernel for device '{device}' ({reason}); "
        "running the pure-PyTorch reference (correct, not fast).",
        RuntimeWarning,
        stacklevel=3,
    )


def register(
    name: str,
    *,
    check: Callable[..., None],
    fake: Callable[..., Any],
    reference: Callable[..., Any],
    wrapper: Callable[..., Any] | None = None,
) -> OpSpec:
    """Register the fake kernel and the reference fallback of ``topg::<name>`` and
    record the op in the registry.

    ``check(*args)`` validates arguments (shared by both paths, written with
    ``torch._check`` where sizes may be symbolic); ``fake(*args)`` returns empty outputs
    of the right shape; ``reference(*args)`` computes the op in plain PyTorch;
    ``wrapper`` is the typed wrapper ``torch_topg.ops.<name>``.
    """
    assert name in SCHEMAS, f"topg::{name} has no schema in _schemas.py"

    def fallback(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        _note_fallback(name, _first_device(args))
        return reference(*args, **kwargs)

    def fake_kernel(*args: Any, **kwargs: Any) -> Any:
        check(*args, **kwargs)
        return fake(*args, **kwargs)

    fallback.__name__ = f"{name}_fallback"
    LIB.impl(name, fallback, "CompositeExplicitAutograd")
    torch.library.register_fake(f"topg::{name}", fake_kernel, lib=LIB)
    spec = OpSpec(
        name=name,
        schema=SCHEMAS[name],
        check=check,
        fake=fake,
        reference=reference,
        fallback=fallback,
        wrapper=wrapper,
    )
    add(spec)
    return spec


def eager_entry(name: str) -> Callable[..., Any]:
    """The C++ callable behind ``torch.ops.topg.<name>.default``.

    Wrappers call it directly in eager mode: it is what ``OpOverload.__call__`` calls,
    minus one Python frame (about 1 us per call on the 2-core CI machine, a quarter of
    a decode-size op). Under ``torch.compile`` wrappers call the ``OpOverload`` instead,
    which dynamo knows how to put in a graph:

        if torch.compiler.is_compiling():
            return torch.ops.topg.<name>.default(...)
        return _<name>(...)
    """
    assert name in SCHEMAS, f"topg::{name} has no schema in _schemas.py"
    return getattr(torch.ops.topg, name).default._op
