"""The op registry: one :class:`OpSpec` per ``topg`` op, in :data:`OPS`.

``_library.register`` fills it when an op module is imported, so after
``import torch_topg`` every op of ``_schemas.SCHEMAS`` has an entry. It is what the rest
of the package reads instead of reaching into the op modules:

* the XLA registration (``torch_topg/tpu/_xla.py``) takes an op's ``check`` and
  ``reference`` from here;
* the compile passes ask which ops return a fresh tensor (``returns_new_tensor``);
* the tests take every op, its fallback and its kernels per device from here
  (``tests/op_samples.py`` must have samples for each entry).

Which devices have kernels is not stored: it depends on what the native extension
registered in this process, so :meth:`OpSpec.kernel_keys` asks the dispatcher.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

#: The dispatch keys an op may have a device kernel at (besides the reference fallback
#: at ``CompositeExplicitAutograd``).
DEVICE_KEYS: tuple[str, ...] = ("CPU", "CUDA", "XLA")


@dataclass(frozen=True)
class OpSpec:
    """Everything the Python side knows about ``topg::<name>``.

    Attributes:
        name: the op name (``torch.ops.topg.<name>``).
        schema: its schema string, from ``_schemas.SCHEMAS``.
        check: ``check(*args, **kwargs)`` raises ``RuntimeError`` on bad arguments, in
            the wording of the native checks; run by the fake, the fallback and the XLA
            kernel.
        fake: returns empty outputs of the right shape (called after ``check``).
        reference: the pure-PyTorch semantics (``torch_topg.reference.<name>``).
        fallback: the kernel registered at ``CompositeExplicitAutograd``: ``check``, a
            once-per-device warning, then ``reference``.
        wrapper: the typed wrapper ``torch_topg.ops.<name>``.
    """

    name: str
    schema: str
    check: Callable[..., None]
    fake: Callable[..., Any]
    reference: Callable[..., Any]
    fallback: Callable[..., Any]
    wrapper: Callable[..., Any] | None = None

    @property
    def overload(self) -> torch._ops.OpOverload:
        """``torch.ops.topg.<name>.default``."""
        return getattr(torch.ops.topg, self.name).default

    def has_kernel(self, dispatch_key: str) -> bool:
        """Whether a kernel is registered exactly at ``dispatch_key`` (e.g. ``"CUDA"``)."""
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"topg::{self.name}", dispatch_key)

    def kernel_keys(self) -> tuple[str, ...]:
        """The device keys of :data:`DEVICE_KEYS` with a kernel in this process; a device
        not listed runs the reference fallback."""
        return tuple(k for k in DEVICE_KEYS if self.has_kernel(k))

    @property
    def arg_names(self) -> tuple[str, ...]:
        """The argument names of the schema, in order."""
        return tuple(a.name for a in self.overload._schema.arguments)

    @property
    def mutated_args(self) -> tuple[str, ...]:
        """Names of the arguments the op writes in place (``Tensor(a!)``)."""
        return tuple(
            a.name
            for a in self.overload._schema.arguments
            if a.alias_info is not None and a.alias_info.is_write
        )

    @property
    def returns_new_tensor(self) -> bool:
        """One ``Tensor`` result that aliases nothing (a fresh temporary), and no argument
        written in place."""
        returns = self.overload._schema.returns
        return (
            len(returns) == 1
            and isinstance(returns[0].type, torch.TensorType)
            and returns[0].alias_info is None
            and not self.mutated_args
        )


#: Every registered op by name, in registration order.
OPS: dict[str, OpSpec] = {}

#: Device kernels not written yet: op -> {dispatch key: why}. Such an op runs its
#: reference fallback on that device; tests/test_library.py and the CUDA lane's check
#: skip it there, naming the reason, and fail once the kernel exists and the entry is
#: stale. docs/ops.md shows the same.
PENDING_KERNELS: dict[str, dict[str, str]] = {}


def pending(name: str, dispatch_key: str) -> str | None:
    """Why ``topg::<name>`` has no kernel at ``dispatch_key`` yet (None: it must have one)."""
    return PENDING_KERNELS.get(name, {}).get(dispatch_key)


def add(spec: OpSpec) -> None:
    """Record ``spec`` (``_library.register`` calls this); an op is registered once."""
    if spec.name in OPS:
        raise RuntimeError(f"topg::{spec.name} is already in the op registry")
    OPS[spec.name] = spec
