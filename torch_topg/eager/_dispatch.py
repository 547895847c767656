"""Dispatcher-level interception: topg kernels as the CPU (and CUDA) kernels of aten ops.

The work is done in C++ (``csrc/cpu/intercept.cpp``): ``topg::_enable_interception``
registers adapter kernels for the aten ops below in heap-allocated ``torch::Library``
objects; ``topg::_disable_interception`` destroys them, which restores the dispatch
table exactly. Once enabled, a call such as ``F.scaled_dot_product_attention`` goes
from the dispatcher straight to C++ adapter code: no Python runs per op call.

Which aten ops are intercepted is decided by measurement
(``python/benchmarks/eager_enable.py``, see ``docs/integrations.md``):

* ``scaled_dot_product_attention`` -> ``topg::attention``: faster at decode (one query
  row: aten's CPU flash kernel splits work poorly there) and at prefill sizes.
* ``rms_norm`` -> ``topg::rms_norm``: one fused pass instead of aten's CPU composite
  (pow, mean, rsqrt, mul, mul).
* ``linear`` -> ``topg::linear``: bf16 / fp16 at every size (aten's CPU half-precision
  GEMM is slow without AVX-512 BF16 / AMX); fp32 up to 16 rows (decode) and from 128
  rows with at least 512 outputs (prefill), where topg measured faster than MKL.

Not intercepted: ops with their own CPU kernels (``silu``, ``mul``, ``add``): topg has
nothing faster for one such op; fusing them is the module-level routing's job
(:mod:`torch_topg.eager.modules`).
"""

from __future__ import annotations

import torch

from torch_topg import _native

#: aten ops routed to topg while enabled.
INTERCEPTED_OPS: tuple[str, ...] = ("scaled_dot_product_attention", "rms_norm", "linear")


def available() -> str | None:
    """None when dispatcher interception can be used, else why not."""
    if not _native.is_loaded():
        return f"needs the native extension ({_native.missing_reason('cpu')})"
    return None


def enable(ops: tuple[str, ...] = INTERCEPTED_OPS) -> list[str]:
    """Register the adapters; returns ``"<aten op>.<dispatch key>"`` per registration."""
    return list(torch.ops.topg._enable_interception.default(list(ops)))


def disable() -> None:
    torch.ops.topg._disable_interception.default()
