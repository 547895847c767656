"""CUDA kernels of the quantised-weight ops (csrc/cuda/linear_q.cu, fused_moe_q.cu)
against their references on the same GPU, at the sizes that pick each path: linear_q's
GEMV (M <= 8) and de-quantise + cuBLAS path (M > 8); embedding_q (the reference's
floats, bit for bit); fused_moe_q's per-assignment GEMVs (T * k <= 128, or int8
activations) and its de-quantised fp32 fused_moe path (more assignments).

The samples every op shares with the CPU run in tests/test_ops_common.py for both
devices. Every test skips without a CUDA device or without the CUDA kernel.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import NEEDS_CUDA, TOL, requires_cuda_kernel
from hypothesis import given
from hypothesis import strategies as st
from op_samples import Gen, packed_weight

import torch_topg
from torch_topg import reference
from torch_topg.quant import FORMATS

pytestmark = NEEDS_CUDA
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _k(fmt: str, blocks: int, tail: int) -> int:
    f = FORMATS[fmt]
    return blocks * (f.block or 32) + (tail if f.pads else 0)


@requires_cuda_kernel("linear_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
@given(
    m=st.sampled_from([1, 3, 8, 9, 40]),
    n=st.integers(1, 40),
    blocks=st.integers(1, 3),
    tail=st.integers(0, 31),
    dtype=st.sampled_from(DTYPES),
    int8_act=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_cuda_linear_q(fmt, m, n, blocks, tail, dtype, int8_act, bias, seed):
    k = _k(fmt, blocks, tail)
    g = Gen("cuda", seed=seed)
    w, x = packed_weight(g, fmt, n, k), g.randn(m, k, dtype=dtype)
    b = g.randn(n, dtype=dtype) if bias else None
    got = torch_topg.ops.linear_q(x, w, fmt, b, int8_activations=int8_act)
    want = reference.linear_q(x, w, fmt, b, int8_activations=int8_act)
    atol, rtol = TOL[dtype]
    scale = max(1.0, float(np.sqrt(k / 64)))
    mag = max(1.0, float(want.float().abs().max()))  # the K-quants' seeded bytes
    torch.testing.assert_close(got, want, atol=atol * scale * mag, rtol=rtol * scale)


@requires_cuda_kernel("embedding_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cuda_embedding_q_bit_exact(fmt):
    f = FORMATS[fmt]
    d = 2 * (f.block or 40) + (7 if f.pads else 0)
    g = Gen("cuda", seed=5)
    w = packed_weight(g, fmt, 50, d)
    ids = g.randint(50, 3, 40)
    for dtype in DTYPES:
        got = torch_topg.ops.embedding_q(ids, w, fmt, d, dtype)
        assert torch.equal(got, reference.embedding_q(ids, w, fmt, d, dtype)), dtype
        assert torch.equal(
            got, torch_topg.ops.embedding_q(ids.cpu(), w.cpu(), fmt, d, dtype).cuda()
        )


@requires_cuda_kernel("fused_moe_q")
@pytest.mark.parametrize(
    "fmt", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "int8", "int4_g64"]
)
@given(
    tokens=st.sampled_from([1, 5, 64, 65, 150]),
    e=st.integers(1, 6),
    top_k=st.integers(1, 2),
    dtype=st.sampled_from(DTYPES),
    act=st.sampled_from(["silu", "gelu", "gelu_tanh"]),
    int8_act=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_cuda_fused_moe_q(fmt, tokens, e, top_k, dtype, act, int8_act, seed):
    g = Gen("cuda", seed=seed)
    h, i = _k(fmt, 1, 5), _k(fmt, 1, 9)
    wgu = torch.stack([packed_weight(g, fmt, 2 * i, h) for _ in range(e)])
    wd = torch.stack([packed_weight(g, fmt, h, i) for _ in range(e)])
    x = g.randn(tokens, h, dtype=dtype)
    top_k = min(top_k, e)
    ids = torch.stack([torch.randperm(e)[:top_k] for _ in range(tokens)]).to("cuda")
    tw = g.rand(tokens, top_k)
    kw = dict(activation=act, int8_activations=int8_act)
    got = torch_topg.ops.fused_moe_q(x, wgu, wd, tw, ids, fmt, **kw)
    want = reference.fused_moe_q(x, wgu, wd, tw, ids, fmt, **kw)
    atol, rtol = TOL[dtype]
    mag = max(1.0, float(want.float().abs().max()))
    scale = max(1.0, float(np.sqrt(max(h, i) / 64)))
    if int8_act:  # h rounded after it was summed in another order: one code may move
        atol = max(atol * scale, 2 / 127)
    torch.testing.assert_close(got, want, atol=atol * scale * mag, rtol=rtol * scale * 2)


@requires_cuda_kernel("fused_moe_q")
def test_cuda_fused_moe_q_bad_ids_with_checks():
    g = Gen("cuda", seed=3)
    wgu = torch.stack([packed_weight(g, "q8_0", 64, 64) for _ in range(3)])
    wd = torch.stack([packed_weight(g, "q8_0", 64, 32) for _ in range(3)])
    x, tw = g.randn(4, 64), g.rand(4, 2)
    ids = torch.tensor([[0, 1], [2, 3], [1, 1], [0, 2]], device="cuda")
    with (
        torch_topg.index_checks(),
        pytest.raises(RuntimeError, match=r"expert id 3 at flat index 3"),
    ):
        torch_topg.ops.fused_moe_q(x, wgu, wd, tw, ids, "q8_0")
    # checks off: the bad assignment contributes nothing (no read past the experts)
    got = torch_topg.ops.fused_moe_q(x, wgu, wd, tw, ids, "q8_0")
    keep = ids < 3
    want = reference.fused_moe_q(x, wgu, wd, tw * keep, ids.clamp(max=2), "q8_0")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
