"""The CUDA dispatch on a GPU: every candidate of every dispatched op against the op's
reference at the small shapes ``tune`` checks, the choice the op makes by itself (and its
report), and deterministic mode. Skips without a CUDA device or without topg's CUDA
kernels (then nothing is dispatched). The logic itself is tested on the CPU in
tests/test_gpu_dispatch.py.
"""

from __future__ import annotations

import pytest
import torch
from conftest import NEEDS_CUDA, requires_cuda_kernel

import torch_topg
from torch_topg import modes
from torch_topg.ops import OPS, dispatch
from torch_topg.ops._schemas import DISPATCHED_ON_CUDA
from torch_topg.ops.dispatch import tune
from torch_topg.ops.dispatch.candidates import candidates

pytestmark = NEEDS_CUDA
DEV = torch.device("cuda")
CASES = [
    (op, c.name, dtype)
    for op in DISPATCHED_ON_CUDA
    for c in candidates(op)
    if c.name != "reference"
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
]


@pytest.fixture(autouse=True)
def unforced():
    """conftest forces topg's kernels for the other CUDA tests; here the choice is free."""
    with dispatch.forced(""):
        yield


@pytest.mark.parametrize(("op", "name", "dtype"), CASES)
def test_cuda_candidate_matches_the_reference(op, name, dtype):
    c = next(x for x in candidates(op) if x.name == name)
    args, kwargs = tune.SMALL[op](dtype)(DEV)
    why = c.unavailable() or c.supports(*args, **kwargs)
    if why is not None:
        pytest.skip(f"{op}/{name} cannot take the {dtype} call here: {why}")
    got = c.run(*args, config=None, **kwargs) if c.tunable else c.run(*args, **kwargs)
    want = OPS[op].reference(*args, **kwargs)
    atol, rtol = tune.TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("op", DISPATCHED_ON_CUDA)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_dispatched_op_matches_the_reference_and_reports(op, dtype):
    if op not in dispatch.INSTALLED:
        pytest.skip(f"no topg CUDA kernel for {op}: nothing dispatched")
    args, kwargs = tune.SMALL[op](dtype)(DEV)
    got = getattr(torch_topg.ops, op)(*args, **kwargs)
    want = OPS[op].reference(*args, **kwargs)
    atol, rtol = tune.TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
    report = torch_topg.dispatch_report()
    ran = [d for d in report.decisions if d.op == op and d.device.startswith("cuda") and d.calls]
    assert ran and ran[-1].source in ("table", "fixed order"), str(report)
    assert f"{op} [" in str(report)


@requires_cuda_kernel("linear")
def test_cuda_deterministic_mode_is_fixed_whatever_the_batch():
    restore = modes.batch_invariant_mode()
    try:
        w = torch.randn(64, 128, device=DEV, dtype=torch.bfloat16)
        for m in (1, 3, 16, 200):
            x = torch.randn(m, 128, device=DEV, dtype=torch.bfloat16)
            torch_topg.ops.linear(x, w)
            d = dispatch.DEFAULT.decision("linear", (x, w), {})
            assert (d.candidate.name, d.source) == ("topg", "deterministic")
    finally:
        restore()
