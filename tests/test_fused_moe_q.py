"""``fused_moe_q``: the reference against ``fused_moe`` on the de-quantised experts, and the
native kernel (where one is registered) against the reference over hypothesis shapes:
tokens from 1 to 96 (experts with at most 16 rows take the GEMV, more rows the
de-quantise + mm path), hidden and intermediate sizes not a multiple of the int4 group,
a different down format, every activation, with and without ``int8_activations`` (the
reference rounds ``x`` and ``h`` as the kernel does: fp32 tolerance)."""

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
from torch_topg.quant import FORMATS


def experts(g: Gen, fmt: str, e: int, n: int, k: int) -> torch.Tensor:
    """``e`` experts of ``n`` packed rows of ``k`` weights: uint8 ``[e, n, row_bytes(k)]``."""
    return torch.stack([packed_weight(g, fmt, n, k) for _ in range(e)])


def sizes(fmt: str, blocks: int, tail: int) -> int:
    f = FORMATS[fmt]
    return blocks * (f.block or 32) + (tail if f.pads else 0)


def test_reference_is_fused_moe_on_dequantised_experts():
    g = Gen("cpu", seed=1)
    e, t, k, h, i = 4, 9, 2, 64, 96
    wgu, wd = experts(g, "q4_1", e, 2 * i, h), experts(g, "q8_0", e, h, i)
    x, ids, tw = g.randn(t, h), g.randint(e, t, k), g.rand(t, k)
    dense_gu = torch_topg.quant.dequantize(wgu, "q4_1", h)
    dense_d = torch_topg.quant.dequantize(wd, "q8_0", i)
    for act in ("silu", "gelu", "gelu_tanh"):
        got = reference.fused_moe_q(x, wgu, wd, tw, ids, "q4_1", down_format="q8_0", activation=act)
        expected = reference.fused_moe(x, dense_gu, dense_d, tw, ids, activation=act)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@requires_kernel("fused_moe_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
@given(
    tokens=st.sampled_from([1, 2, 5, 16, 40, 96]),
    e=st.integers(1, 6),
    top_k=st.integers(1, 3),
    hb=st.integers(1, 2),
    ib=st.integers(1, 3),
    tail=st.integers(0, 31),
    down=st.sampled_from([None, "q8_0", "int4_g32"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    act=st.sampled_from(["silu", "gelu", "gelu_tanh"]),
    int8_act=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_native_matches_reference(fmt, tokens, e, top_k, hb, ib, tail, down, dtype, act, int8_act, seed):  # fmt: skip
    h, i = sizes(fmt, hb, tail), sizes(down or fmt, ib, (tail * 7) % 32)
    g = Gen("cpu", seed=seed)
    wgu, wd = experts(g, fmt, e, 2 * i, h), experts(g, down or fmt, e, h, i)
    x = g.randn(tokens, h, dtype=dtype)
    top_k = min(top_k, e)
    ids = torch.stack([torch.randperm(e, generator=g.g)[:top_k] for _ in range(tokens)])
    tw = g.rand(tokens, top_k)
    kw = dict(down_format=down, activation=act, int8_activations=int8_act)
    got = torch_topg.ops.fused_moe_q(x, wgu, wd, tw, ids, fmt, **kw)
    expected = reference.fused_moe_q(x, wgu, wd, tw, ids, fmt, **kw)
    atol, rtol = TOL[dtype]
    scale = max(1.0, float(np.sqrt(max(h, i) / 64)))
    # the K-quants' seeded bytes are not normalised weights: outputs reach ~100, and a
    # sum's rounding error grows with its terms, not with the output
    magnitude = max(1.0, float(expected.float().abs().max()))
    if int8_act:
        # h is rounded to int8 blocks after the kernel and the reference computed it in
        # other orders: a value on a rounding boundary moves by one code (1/127 of its
        # block's largest value), which moves its token's whole output row a little
        atol = max(atol * scale, 2 / 127) * magnitude
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol * scale)
        return
    torch.testing.assert_close(got, expected, atol=atol * scale * magnitude, rtol=rtol * scale)


@requires_kernel("fused_moe_q")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q6_k", "int4_g64"])
def test_native_batch_invariant(fmt):
    """In batch-invariant mode every expert takes the GEMV (16 rows at a time), so a
    token's output does not depend on which tokens share its experts."""
    f = FORMATS[fmt]
    h = i = 2 * (f.block or 32)
    g = Gen("cpu", seed=7)
    e, t = 3, 50  # ~33 rows per expert: more than the GEMV's 16
    wgu, wd = experts(g, fmt, e, 2 * i, h), experts(g, fmt, e, h, i)
    x, ids, tw = g.randn(t, h), g.randint(e, t, 2), g.rand(t, 2)
    previous = torch.ops.topg._set_batch_invariant(True)
    try:
        for a8 in (False, True):
            full = torch_topg.ops.fused_moe_q(x, wgu, wd, tw, ids, fmt, int8_activations=a8)
            for j in (0, 17, 49):
                s = slice(j, j + 1)
                one = torch_topg.ops.fused_moe_q(
                    x[s], wgu, wd, tw[s], ids[s], fmt, int8_activations=a8
                )
                assert torch.equal(full[s], one), (a8, j)
    finally:
        torch.ops.topg._set_batch_invariant(previous)


@requires_kernel("fused_moe_q")
def test_native_equals_linear_q_per_expert():
    """One token routed to one expert with weight 1 (fp32, GEMV path): the output is
    linear_q(silu(linear_q(x, Wg)) * linear_q(x, Wu), Wd) up to the rounding of the
    intermediate (linear_q rounds nothing in fp32): the same kernels, so equal."""
    g = Gen("cpu", seed=8)
    e, h, i = 3, 64, 96
    wgu, wd = experts(g, "q4_0", e, 2 * i, h), experts(g, "q4_0", e, h, i)
    x = g.randn(1, h)
    for ex in range(e):
        got = torch_topg.ops.fused_moe_q(x, wgu, wd, torch.ones(1, 1), torch.tensor([[ex]]), "q4_0")
        gu = torch_topg.ops.linear_q(x, wgu[ex], "q4_0")
        hid = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        expected = torch_topg.ops.linear_q(hid, wd[ex], "q4_0")
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)


@requires_kernel("fused_moe_q")
def test_native_skips_experts_not_hit():
    """Experts no token is routed to are never read: NaN bytes there change nothing."""
    g = Gen("cpu", seed=9)
    e, h, i = 4, 64, 32
    wgu, wd = experts(g, "q8_0", e, 2 * i, h), experts(g, "q8_0", e, h, i)
    x, ids, tw = g.randn(6, h), g.ints([[0, 2]] * 6, torch.int64), g.rand(6, 2)
    poisoned_gu, poisoned_d = wgu.clone(), wd.clone()
    nan = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
    poisoned_gu[1, :, 0:2] = nan
    poisoned_d[3, :, 0:2] = nan
    a = torch_topg.ops.fused_moe_q(x, wgu, wd, tw, ids, "q8_0")
    b = torch_topg.ops.fused_moe_q(x, poisoned_gu, poisoned_d, tw, ids, "q8_0")
    assert torch.equal(a, b) and torch.isfinite(a).all()


@requires_kernel("fused_moe_q")
@pytest.mark.parametrize("fmt,down", [("q4_0", None), ("q8_0", "int4_g32"), ("q4_k", "q6_k"),
                                      ("q5_k", None), ("int8", None)])  # fmt: skip
def test_native_int8_expert_items_match_reference(fmt, down):
    """int8 activations, experts with 4 to 16 rows (a decode step of a batch): the work
    items take linear_q's integer GEMM on their strip of rows on a VNNI CPU
    (moe_items.h, quant::use_gemm_q8), the GEMV elsewhere; both near the reference."""
    h, i = sizes(fmt, 2, 5), sizes(down or fmt, 1, 9)
    g = Gen("cpu", seed=41)
    e = 2
    wgu, wd = experts(g, fmt, e, 2 * i, h), experts(g, down or fmt, e, h, i)
    for tokens in (8, 24, 32):  # 4, 12 and 16 rows per expert
        x = g.randn(tokens, h)
        ids = (torch.arange(tokens) % e).view(-1, 1)
        tw = g.rand(tokens, 1)
        kw = dict(down_format=down, int8_activations=True)
        got = torch_topg.ops.fused_moe_q(x, wgu, wd, tw, ids, fmt, **kw)
        expected = reference.fused_moe_q(x, wgu, wd, tw, ids, fmt, **kw)
        magnitude = max(1.0, float(expected.abs().max()))  # as test_native_matches_reference
        scale = max(1.0, float(np.sqrt(max(h, i) / 64)))
        atol = max(TOL[torch.float32][0] * scale, 2 / 127) * magnitude
        torch.testing.assert_close(got, expected, atol=atol, rtol=TOL[torch.float32][1] * scale)
