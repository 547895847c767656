"""How a Pallas kernel runs on torch tensors: through torch_xla on a TPU, or in Pallas
interpret mode on CPU tensors (tests, and the CPU check of the torch-side glue).

A backend's ``call(fn, tensors, outs, **static)`` runs ``fn(*tensors, **static)``, where
``fn`` is one of the ``*_call`` / ``*_kernel`` functions of ``torch_topg._tpu_kernels``
holding exactly one ``pallas_call``, and returns torch tensors of the shapes and dtypes in
``outs``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

OutSpec = tuple[Sequence[int], torch.dtype]


class XlaBackend:
    """torch_xla: the kernel is traced by JAX (``interpret=False``), its Mosaic payload
    extracted and issued as a TPU custom call on the XLA tensors. ``trace_pallas`` with
    ``use_cache=True`` keys the payload on shapes, dtypes and static arguments, so a
    decode loop traces each kernel once. (``make_kernel_from_pallas`` is the same two
    steps without the cache.)"""

    def call(
        self,
        fn: Callable[..., Any],
        tensors: Sequence[torch.Tensor],
        outs: Sequence[OutSpec],
        **static: Any,
    ) -> list[torch.Tensor]:
        import torch_xla
        from torch_xla.experimental.custom_kernel import trace_pallas

        payload, args = trace_pallas(
            fn, *tensors, static_argnames=tuple(static), use_cache=True, **static
        )
        return list(
            torch_xla._XLAC._xla_tpu_custom_call(
                list(args), payload, [list(s) for s, _ in outs], [d for _, d in outs]
            )
        )


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: go through the bits
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def to_torch(a: Any) -> torch.Tensor:
    arr = np.asarray(a)
    if arr.dtype.name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(arr.copy())


@functools.cache
def _jitted(fn: Callable[..., Any], names: tuple[str, ...]) -> Callable[..., Any]:
    import jax

    return jax.jit(fn, static_argnames=names)


class InterpretBackend:
    """Pallas interpret mode on the CPU: tensors go to JAX through numpy and back. The
    jitted kernel is cached per (kernel, static argument names); JAX caches the
    compilation per shape and static values."""

    def call(
        self,
        fn: Callable[..., Any],
        tensors: Sequence[torch.Tensor],
        outs: Sequence[OutSpec],
        **static: Any,
    ) -> list[torch.Tensor]:
        import jax.numpy as jnp

        static = {**static, "interpret": True}
        result = _jitted(fn, tuple(sorted(static)))(
            *(jnp.asarray(to_numpy(t)) for t in tensors), **static
        )
        result = result if isinstance(result, (list, tuple)) else [result]
        device = tensors[0].device  # back where the inputs live (e.g. an XLA device)
        out = [to_torch(r).to(device) for r in result]
        for o, (shape, dtype) in zip(out, outs, strict=True):
            assert tuple(o.shape) == tuple(shape) and o.dtype == dtype, (
                o.shape,
                o.dtype,
                shape,
                dtype,
            )
        return out
