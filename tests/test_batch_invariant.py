"""The kernels' batch-invariant mode (``topg::_set_batch_invariant``, the engine's
``deterministic=True``): a row's result of ``linear`` and ``fused_moe`` is bitwise the
same computed alone and inside batches of any size; without the mode the small-M and
large-M paths round differently (checked, so the test can fail)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DTYPES
from hypothesis import given
from hypothesis import strategies as st

import torch_topg

pytestmark = pytest.mark.skipif(
    not torch_topg.native_available(),
    reason="needs the native CPU kernels (not built, or TOPG_DISABLE_NATIVE=1)",
)


@contextlib.contextmanager
def batch_invariant(enabled: bool):
    prev = torch.ops.topg._set_batch_invariant.default(enabled)
    try:
        yield
    finally:
        torch.ops.topg._set_batch_invariant.default(prev)


def _rows_alone_and_batched(fn, x):
    alone = torch.cat([fn(x[i : i + 1]) for i in range(4)])
    return alone, [fn(x[:m])[:4] for m in (4, 17, 40, x.shape[0])]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_rows_independent_of_batch(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 300, generator=g).to(dtype)
    w = (torch.randn(130, 300, generator=g) * 0.05).to(dtype)
    fn = lambda a: torch_topg.ops.linear(a, w)  # noqa: E731
    with batch_invariant(True):
        alone, batched = _rows_alone_and_batched(fn, x)
    for b in batched:
        assert torch.equal(alone, b)
    if dtype == torch.float32:  # (16-bit outputs round most of the difference away)
        with batch_invariant(False):
            alone, batched = _rows_alone_and_batched(fn, x)
        assert not all(torch.equal(alone, b) for b in batched), "the mode would not be needed"


@given(
    dtype=st.sampled_from(DTYPES),
    k=st.sampled_from([576, 1536, 1000, 2100, 32, 40, 48, 56, 63]) | st.integers(1, 700),
)
def test_linear_dot_path_rows_independent_of_rows(dtype, k):
    """Without the mode, the dot path (up to 16 rows: decode and speculative verify steps)
    still gives each row the sums it gets alone, whatever kernel a row count takes (the
    one-row GEMV, the AVX-512 passes of up to 8 rows, the AVX-512 BF16 dot products):
    a verify step's logits must equal the decode step's."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(16, k, generator=g).to(dtype)
    w = (torch.randn(37, k, generator=g) / k**0.5).to(dtype)
    fn = lambda a: torch_topg.ops.linear(a, w)  # noqa: E731
    alone = torch.cat([fn(x[i : i + 1]) for i in range(16)])
    for m in (2, 3, 5, 8, 9, 16):
        assert torch.equal(fn(x[:m]), alone[:m]), f"rows of a {m}-row call"


def test_fused_moe_rows_independent_of_batch():
    g = torch.Generator().manual_seed(1)
    E, H, I, T = 4, 64, 96, 60  # noqa: E741
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    w2 = torch.randn(E, H, I, generator=g) * 0.05
    weights, ids = torch_topg.ops.moe_topk(torch.randn(T, E, generator=g), 2, renormalize=True)

    def fn(a):
        n = a.shape[0]
        return torch_topg.ops.fused_moe(a, w13, w2, weights[:n], ids[:n])

    with batch_invariant(True):
        alone = torch.cat(
            [
                torch_topg.ops.fused_moe(x[i : i + 1], w13, w2, weights[i : i + 1], ids[i : i + 1])
                for i in range(4)
            ]
        )
        for m in (4, 30, T):
            assert torch.equal(alone, fn(x[:m])[:4])


def test_mode_is_restored():
    before = torch.ops.topg._set_batch_invariant.default(False)
    torch.ops.topg._set_batch_invariant.default(before)
    with batch_invariant(True):
        assert torch.ops.topg._set_batch_invariant.default(True) is True
    assert torch.ops.topg._set_batch_invariant.default(before) is before
