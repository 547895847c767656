"""Helpers of the vLLM lane's tests (``make vllm-test``; docs/integrations.md).

Importing this module picks vLLM's platform before vLLM is imported: CPU where no GPU is
visible (``VLLM_TARGET_DEVICE=cpu``), so that vLLM can build its configs here.
``compare()`` counts the comparisons with vLLM's ``forward_native``;
``test_vllm_layers.py`` prints the count when its tests are done.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

COUNTS = {"run": 0, "passed": 0}

# vLLM's own tolerances for an implementation against its native one (vllm/ir/tolerances.py).
TOLERANCES = {
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.bfloat16: {"atol": 1e-3, "rtol": 1.6e-2},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
}


def compare(
    actual: torch.Tensor, expected: torch.Tensor, scale: float = 1.0, atol: float | None = None
) -> None:
    """``actual`` (topg) against ``expected`` (vLLM), with vLLM's tolerances (``atol``:
    where the reference itself rounds intermediate results), counted."""
    COUNTS["run"] += 1
    tol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(
        actual,
        expected,
        atol=tol["atol"] * scale if atol is None else atol,
        rtol=tol["rtol"] * scale,
    )
    COUNTS["passed"] += 1
