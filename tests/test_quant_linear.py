"""``linear_q``: the reference against gguf-py's de-quantiser and float64 math, and the
native kernel (where one is registered) against the reference over hypothesis shapes:
M from 1 to 512, K not a multiple of the int4 group, every format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TOL, requires_kernel
from hypothesis import given
from hypothesis import strategies as st
from op_samples import Gen, packed_weight

import torch_topg
from torch_topg import reference
from torch_topg.quant import FORMATS, GGUF_FORMATS

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_reference_is_gguf_dequantised_weight(fmt):
    """The reference equals x @ W.T in float64 with W from gguf-py's de-quantiser."""
    g = Gen("cpu", seed=3)
    k = 2 * FORMATS[fmt].block
    w = packed_weight(g, fmt, 13, k)
    x, b = g.randn(4, k), g.randn(13)
    dense = torch.from_numpy(gguf.quants.dequantize(w.numpy(), FORMATS[fmt].gguf_type))
    expected = (x.double() @ dense.double().T + b.double()).float()
    torch.testing.assert_close(reference.linear_q(x, w, fmt, b), expected, atol=1e-5, rtol=1e-5)


def test_reference_rounds_once():
    """bf16 input: within half a bf16 ulp of the exact product (a bf16 weight or a bf16
    accumulation would be further off)."""
    g = Gen("cpu", seed=4)
    w = packed_weight(g, "int4_g64", 7, 200)
    x = g.randn(64, 200, dtype=torch.bfloat16)
    dense = torch_topg.quant.dequantize(w, "int4_g64", 200)
    exact = x.double() @ dense.double().T
    got = reference.linear_q(x, w, "int4_g64")
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-6).all()


@requires_kernel("linear_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
@given(
    m=st.sampled_from([1, 2, 3, 7, 16, 33, 512]),
    n=st.integers(1, 40),
    blocks=st.integers(1, 4),
    tail=st.integers(0, 31),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31),
)
def test_native_matches_reference(fmt, m, n, blocks, tail, dtype, seed):
    f = FORMATS[fmt]
    k = blocks * (f.block or 32) + (tail if f.pads else 0)
    g = Gen("cpu", seed=seed)
    w = packed_weight(g, fmt, n, k)
    x = g.randn(m, k, dtype=dtype)
    got = torch_topg.ops.linear_q(x, w, fmt)
    expected = reference.linear_q(x, w, fmt)
    atol, rtol = TOL[dtype]
    scale = max(1.0, float(np.sqrt(k / 64)))
    torch.testing.assert_close(got, expected, atol=atol * scale, rtol=rtol * scale)
