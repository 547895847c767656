"""``linear_q``: the reference against gguf-py's de-quantiser and float64 math, and the
native kernel (where one is registered) against the reference over hypothesis shapes:
M from 1 to 512 (the CPU GEMV at M <= 16, the GEMM path above), K not a multiple of the
int4 group, every format, with and without ``int8_activations`` (the reference rounds
the activations as the kernel does: the comparison stays at fp32 tolerance)."""

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
from torch_topg.formats import activation_group, dequantize, quantize_activations
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


def test_quantize_activations_model():
    """Per block of 32: scale amax / 127, round half to even; zero blocks stay zero."""
    x = torch.zeros(2, 40)
    x[0, :32] = torch.linspace(-1, 1, 32) * 127
    x[0, 5] = 2.5  # 2.5 / 1 rounds to 2 (half to even)
    x[1, 33] = 3.0  # the second block of row 1: alone, it is its own amax
    q = quantize_activations(x)
    assert q[0, 5].item() == 2.0 and q[0, 0].item() == -127.0
    assert q[1, 33].item() == 3.0 and (q[1, :33] == 0).all() and q.shape == (2, 40)
    # groups of 256 (the K-quants): one scale for all 40 values (zero padded to 256)
    x[1, 0] = 127.0
    q = quantize_activations(x, 256)
    assert q[1, 33].item() == 3.0 and q[1, 0].item() == 127.0 and q.shape == (2, 40)
    x[1, 34] = 0.3  # 0.3 / (127 / 127) rounds to 0 in row 1's group; alone in a block of 32
    assert quantize_activations(x, 256)[1, 34].item() == 0.0
    assert quantize_activations(x)[1, 34].item() == pytest.approx(0.3, rel=5e-2)
    assert [activation_group(f) for f in ("q4_k", "q5_k", "q6_k", "q4_0", "q8_0", "int4_g32")] == [
        256,
        256,
        256,
        32,
        32,
        32,
    ]
    with pytest.raises(ValueError, match="group must be 32 or 256"):
        quantize_activations(x, 64)


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
    m=st.sampled_from([1, 2, 3, 4, 5, 16, 33, 512]),
    n=st.integers(1, 40),
    blocks=st.integers(1, 4),
    tail=st.integers(0, 31),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    int8_act=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_native_matches_reference(fmt, m, n, blocks, tail, dtype, int8_act, seed):
    f = FORMATS[fmt]
    k = blocks * (f.block or 32) + (tail if f.pads else 0)
    g = Gen("cpu", seed=seed)
    w = packed_weight(g, fmt, n, k)
    x = g.randn(m, k, dtype=dtype)
    got = torch_topg.ops.linear_q(x, w, fmt, int8_activations=int8_act)
    expected = reference.linear_q(x, w, fmt, int8_activations=int8_act)
    if int8_act and fmt in K_QUANTS and dtype == torch.float32:
        _assert_int8_close(got, expected, x, w, fmt, k)  # seeded bytes: terms that cancel
        return
    atol, rtol = TOL[dtype]
    scale = max(1.0, float(np.sqrt(k / 64)))
    torch.testing.assert_close(got, expected, atol=atol * scale, rtol=rtol * scale)


K_QUANTS = ("q4_k", "q5_k", "q6_k")
# Activation rows from which linear_q takes the integer GEMM with int8 activations on a
# CPU with AVX-512 VNNI (quant::kQ8GemmRows, gemm_q8_vnni.h).
GEMM_ROWS = 4


def _assert_int8_close(got, expected, x, w, fmt, k):
    """int8 activations: within a few ulps of the sum of |terms| (the integer kernels sum
    the block terms w = dw * u + cw as two products, and the K-quants' seeded bytes give
    large terms that cancel)."""
    terms = (
        quantize_activations(x.float(), activation_group(fmt)).abs() @ dequantize(w, fmt, k).abs().T
    )
    err = (got.float() - expected.float()).abs()
    assert (err <= 1e-5 + 4e-7 * k**0.5 * terms).all(), f"{fmt} {k}: {err.max()}"


@requires_kernel("linear_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
@given(
    m=st.sampled_from([GEMM_ROWS, 5, 6, 7, 8, 13, 16, 17, 64]),
    n=st.integers(1, 70),
    blocks=st.integers(1, 3),
    tail=st.integers(1, 31),
    seed=st.integers(0, 2**31),
)
def test_native_int8_gemm_matches_reference(fmt, m, n, blocks, tail, seed):
    """int8 activations, M from the GEMM threshold to 64 (decode steps of a batch, short
    prefills): on a VNNI CPU the integer GEMM (gemm_q8_vnni.h: strips of 32 weight rows
    packed per work item, K-quant scale blocks of 32 and q6_k's of 16), elsewhere the
    GEMV or the de-quantising GEMM. N is rarely a multiple of 16 (a strip's last rows),
    K not a multiple of 256 where the format pads (int8, int4)."""
    f = FORMATS[fmt]
    k = blocks * (f.block or 32) + (tail if f.pads else 0)
    if fmt in K_QUANTS:
        k = blocks * 256
    g = Gen("cpu", seed=seed)
    w = packed_weight(g, fmt, n, k)
    x = g.randn(m, k)
    got = torch_topg.ops.linear_q(x, w, fmt, int8_activations=True)
    expected = reference.linear_q(x, w, fmt, int8_activations=True)
    if fmt in K_QUANTS:
        _assert_int8_close(got, expected, x, w, fmt, k)
    else:
        atol, rtol = TOL[torch.float32]
        scale = max(1.0, float(np.sqrt(k / 64)))
        torch.testing.assert_close(got, expected, atol=atol * scale, rtol=rtol * scale)
    bias = g.randn(n, dtype=torch.bfloat16)
    got16 = torch_topg.ops.linear_q(x.bfloat16(), w, fmt, bias, int8_activations=True)
    expected16 = reference.linear_q(x.bfloat16(), w, fmt, bias, int8_activations=True)
    tol = TOL[torch.bfloat16][0] * (16.0 if fmt in K_QUANTS else 1.0)  # outputs in the 100s
    torch.testing.assert_close(got16, expected16, atol=tol, rtol=tol)


@requires_kernel("linear_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_native_int8_rows_by_mode(fmt):
    """int8 activations. In batch-invariant mode linear_q at M = 16 takes the GEMV for
    every M, so each row equals that row alone, bitwise. Outside it the integer GEMM runs
    from GEMM_ROWS rows on a VNNI CPU (from 8 in the AVX2 form), whose rows do not depend
    on M either (each (weight row, activation row) sum has the same operations in any
    tile): the first 5 rows are the same at M = 5 (8), 16 and 64."""
    f = FORMATS[fmt]
    k = 512 if fmt in K_QUANTS else 2 * (f.block or 32) + (7 if f.pads else 0)
    g = Gen("cpu", seed=31)
    w, x = packed_weight(g, fmt, 37, k), g.randn(64, k)
    previous = torch.ops.topg._set_batch_invariant(True)
    try:
        full = torch_topg.ops.linear_q(x[:16], w, fmt, int8_activations=True)
        for i in range(16):
            one = torch_topg.ops.linear_q(x[i : i + 1], w, fmt, int8_activations=True)
            assert torch.equal(full[i : i + 1], one), i
    finally:
        torch.ops.topg._set_batch_invariant(previous)
    vnni = "avx512_vnni" in torch_topg.modes.cpu_kernels()
    if not vnni and fmt in ("q8_0", "int8"):
        return  # no AVX2 integer GEMM for them: de-quantise + at::mm above 16 rows
    ms = (5, 16, 64) if vnni else (8, 16, 64)  # the AVX2 form: from 8 rows
    rows = [torch_topg.ops.linear_q(x[:m], w, fmt, int8_activations=True)[:5] for m in ms]
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


@requires_kernel("embedding_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_native_embedding_bit_exact(fmt):
    """The native rows are the reference's floats, bit for bit (same float ops)."""
    f = FORMATS[fmt]
    d = 2 * (f.block or 40) + (7 if f.pads else 0)
    g = Gen("cpu", seed=5)
    w = packed_weight(g, fmt, 50, d)
    ids = g.randint(50, 3, 40)
    for dtype in (torch.float32, torch.bfloat16):
        got = torch_topg.ops.embedding_q(ids, w, fmt, d, dtype)
        assert torch.equal(got, reference.embedding_q(ids, w, fmt, d, dtype)), dtype


@requires_kernel("linear_q")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_1", "q6_k", "int4_g64"])
def test_native_batch_invariant(fmt):
    """In batch-invariant mode (the engine's deterministic=True) a row's output does not
    depend on how many rows come with it; outside it M > 16 takes the GEMM path."""
    f = FORMATS[fmt]
    k = 2 * (f.block or 32)
    g = Gen("cpu", seed=6)
    w, x = packed_weight(g, fmt, 33, k), g.randn(37, k)
    previous = torch.ops.topg._set_batch_invariant(True)
    try:
        for act in (False, True):
            full = torch_topg.ops.linear_q(x, w, fmt, int8_activations=act)
            for i in (0, 5, 36):
                one = torch_topg.ops.linear_q(x[i : i + 1], w, fmt, int8_activations=act)
                assert torch.equal(full[i : i + 1], one), (act, i)
    finally:
        torch.ops.topg._set_batch_invariant(previous)


@requires_kernel("linear_q")
@pytest.mark.parametrize("fmt", list(FORMATS))
@given(m=st.integers(2, 16), tail=st.integers(0, 31), seed=st.integers(0, 2**31))
def test_native_gemv_rows_do_not_depend_on_m(fmt, m, tail, seed):
    """fp32 activations, M <= 16 (the decode plan's steps): the GEMV makes each packed
    row fp32 once for all M rows (quant::dot_rows), and every row's output is bitwise
    the output of that row alone, which is what the decode plan relies on."""
    f = FORMATS[fmt]
    k = 3 * (f.block or 32) + (tail if f.pads else 0)
    g = Gen("cpu", seed=seed)
    w, x = packed_weight(g, fmt, 19, k), g.randn(m, k)
    for dtype in (torch.float32, torch.bfloat16):
        xs = x.to(dtype)
        full = torch_topg.ops.linear_q(xs, w, fmt)
        for i in range(m):
            assert torch.equal(full[i : i + 1], torch_topg.ops.linear_q(xs[i : i + 1], w, fmt)), (
                dtype,
                i,
            )


@requires_kernel("linear_q")
@pytest.mark.parametrize("fmt", ["q8_0", "int8", "int4_g128"])
def test_native_gemv_nan_and_inf_rows(fmt):
    """int8 activations: a NaN or an inf in a row makes that row's outputs NaN (its block
    scale is NaN), in the GEMV (M <= 16) and in the GEMM path (the integer GEMM where the
    CPU has AVX-512 VNNI); the other rows are as the reference."""
    g = Gen("cpu", seed=7)
    w = packed_weight(g, fmt, 9, 100 if fmt != "q8_0" else 96)
    for m in (3, 9, 33):
        x = g.randn(m, 100 if fmt != "q8_0" else 96)
        x[1, 50], x[2, 3] = float("nan"), float("inf")
        got = torch_topg.ops.linear_q(x, w, fmt, int8_activations=True)
        assert got[1:3].isnan().all()
        expected = reference.linear_q(x, w, fmt, int8_activations=True)
        assert expected[1:3].isnan().all()
        torch.testing.assert_close(got[::8], expected[::8], atol=2e-5, rtol=2e-5)


@requires_kernel("linear_q")
@given(
    m=st.sampled_from([1, 5, 16, 17, 40]),
    blocks=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_native_int8_rounding_is_quantize_activations(m, blocks, seed):
    """int8 activations: through an identity weight (int8 format, codes 127, scale 1/127)
    linear_q returns the activations as it rounded them, which must be
    quantize_activations' values to fp32 accuracy (one code apart would be 1/127 of a
    block's largest value), in the GEMV (M <= 16) and the GEMM paths. Blocks with amax
    127 (d = 1) and half-integer values test the ties (half to even)."""
    k = 32 * blocks
    g = Gen("cpu", seed=seed)
    x = g.randn(m, k) * 40
    x[::2, :32] = torch.round(x[::2, :32].clamp(-100, 100)) + 0.5  # ties at d = 1 ...
    x[::2, 0] = 127.0  # ... with the block's amax 127
    eye = torch.eye(k, dtype=torch.int8) * 127
    scale = torch.full((k, 1), 1 / 127, dtype=torch.float32).view(torch.uint8)
    w = torch.cat([scale, eye.view(torch.uint8)], dim=1)
    got = torch_topg.ops.linear_q(x, w, "int8", int8_activations=True)
    expected = quantize_activations(x)
    assert torch.equal(expected[::2, :32], torch.round(x[::2, :32]))  # the ties are there
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@requires_kernel("linear_q")
@pytest.mark.parametrize("fmt", ["q4_k", "q5_k", "q6_k"])
@given(m=st.sampled_from([1, 3, 4, 8, 16, 40]), seed=st.integers(0, 2**31))
def test_k_quant_activations_share_a_scale_per_256(fmt, m, seed):
    """int8 activations against a K-quant weight: one scale per super-block of 256
    (activation_group), in the GEMV and the GEMM paths. Rows whose blocks of 32 differ
    in magnitude by 100x tell the two semantics apart: the result must be the
    256-group reference's, far from what scales per 32 would give."""
    k = 512
    g = Gen("cpu", seed=seed)
    w = packed_weight(g, fmt, 24, k)
    x = g.randn(m, k) * 0.05
    x[:, ::64] = 5.0  # one large value per other block of 32
    got = torch_topg.ops.linear_q(x, w, fmt, int8_activations=True)
    expected = reference.linear_q(x, w, fmt, int8_activations=True)
    per32 = quantize_activations(x) @ dequantize(w, fmt, k).T
    terms = quantize_activations(x, 256).abs() @ dequantize(w, fmt, k).abs().T
    assert ((got - expected).abs() <= 1e-5 + 4e-7 * k**0.5 * terms).all()
    assert (expected - per32).abs().max() > 100 * (got - expected).abs().max() + 1e-3


def _run_avx2(tmp_path, script: str, payload: object) -> object:
    """``script`` run in a subprocess with TOPG_DISABLE_AVX512=1 (the AVX2 forms of the
    kernels): it loads ``payload`` from ``sys.argv[1]`` and saves its results to
    ``sys.argv[2]``, which this returns."""
    import os
    import subprocess
    import sys

    path, inp, out = tmp_path / "avx2.py", tmp_path / "in.pt", tmp_path / "out.pt"
    path.write_text(script)
    torch.save(payload, inp)
    env = {**os.environ, "TOPG_DISABLE_AVX512": "1"}
    subprocess.run([sys.executable, str(path), str(inp), str(out)], env=env, check=True,
                   cwd=tmp_path, timeout=300)  # fmt: skip
    return torch.load(out, weights_only=False)


_AVX2_Q8_SCRIPT = """
import sys, torch, torch_topg
x, packed = torch.load(sys.argv[1])
torch.ops.topg._set_batch_invariant(True)  # the GEMV at every M (the GEMM from 8 rows)
out = [torch_topg.ops.linear_q(x[:m, :k].contiguous(), q, f, int8_activations=True)
       for q, f, k in packed for m in (1, 5, 16)]
torch.save(out, sys.argv[2])
"""


@requires_kernel("linear_q")
def test_int8_gemv_forms_match_reference(tmp_path):
    """The int8-activation GEMV (M <= 16; batch-invariant mode here, which keeps it at
    every M) has an AVX-512 VNNI form (quant_act.h:
    vpdpbusd, 8 blocks' scales at a time, then the last nb % 8 blocks one by one) and an
    AVX2 form (maddubs / madd), the same integer products summed in different fp32 orders.
    Both must match the reference: the AVX2 form runs in a subprocess with
    TOPG_DISABLE_AVX512=1. The shapes cover whole groups of 8 blocks with and without a
    tail, a row of fewer than 8 blocks, an int8 / int4 row ending inside a block, and the
    K-quants' super-blocks."""

    from torch_topg.quant import quantize_weight

    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, 1600, generator=g) * 3
    cases = [("q4_1", 576), ("q4_1", 1536), ("q4_1", 96), ("q4_0", 576), ("q8_0", 288),
             ("q8_0", 1536), ("q5_0", 576), ("q5_0", 96), ("q5_1", 1536), ("int4_g32", 575), ("int4_g64", 576), ("int8", 1000), ("int8", 256)]  # fmt: skip
    packed = [
        (quantize_weight(torch.randn(37, k, generator=g) / k**0.5, f), f, k) for f, k in cases
    ]
    # the K-quants (quant_act_k.h): one super-block, and six (K = 1536)
    kq = Gen("cpu", seed=12)
    packed += [
        (packed_weight(kq, f, 37, k), f, k) for f in ("q4_k", "q5_k", "q6_k") for k in (256, 1536)
    ]
    avx2 = _run_avx2(tmp_path, _AVX2_Q8_SCRIPT, (x, packed))
    i = 0
    for q, f, k in packed:
        for m in (1, 5, 16):
            xs = x[:m, :k].contiguous()
            ref = reference.linear_q(xs, q, f, int8_activations=True)
            previous = torch.ops.topg._set_batch_invariant(True)  # the GEMV at every M
            try:
                here = torch_topg.ops.linear_q(xs, q, f, int8_activations=True)
            finally:
                torch.ops.topg._set_batch_invariant(previous)
            # summation-order error: a few ulps of the sum of |terms| (the K-quants' seeded
            # bytes give large terms that cancel)
            terms = (
                quantize_activations(xs, activation_group(f)).abs() @ dequantize(q, f, k).abs().T
            )
            for name, got in (("this CPU's form", here), ("AVX2 form", avx2[i])):
                err = (got - ref).abs()
                assert (err <= 1e-5 + 4e-7 * k**0.5 * terms).all(), f"{name} {f} {k}: {err.max()}"
            i += 1


def _int8_rows(x, packed):
    """linear_q with int8 activations: for each (weight, format, k) in packed, each of
    x's first 16 rows alone and x[:m] for m = 1..16, in batch-invariant mode (the GEMV)."""
    import torch_topg

    out = []
    previous = torch.ops.topg._set_batch_invariant(True)
    try:
        for q, f, k in packed:
            xs = x[:16, :k].contiguous()
            alone = [
                torch_topg.ops.linear_q(xs[i : i + 1], q, f, int8_activations=True)
                for i in range(16)
            ]
            full = [
                torch_topg.ops.linear_q(xs[:m], q, f, int8_activations=True) for m in range(1, 17)
            ]
            out.append((alone, full))
    finally:
        torch.ops.topg._set_batch_invariant(previous)
    return out


@requires_kernel("linear_q")
def test_int8_gemv_rows_do_not_depend_on_m(tmp_path):
    """int8 activations, M <= 16, in batch-invariant mode (which keeps the GEMV for
    every M; outside it M >= GEMM_ROWS takes the GEMM): the GEMV unpacks each weight block once for up to 4
    activation rows (quant_act.h), and every row's output must still be bitwise the
    output of that row alone, for every M (the groups of 4 and the last 1..3 rows), every
    format, in this CPU's form and in the AVX2 form (a subprocess with
    TOPG_DISABLE_AVX512=1). The shapes have a group of 8 blocks and a tail (the VNNI
    form's two loops), rows ending inside a block, two K-quant super-blocks, and 37
    weight rows (two groups of 16 and 5)."""
    import inspect

    g = Gen("cpu", seed=21)
    x = g.randn(16, 512) * 2
    x[3, :32] = 0.0  # a zero block: d = 0
    shape = {"q4_k": 512, "q5_k": 512, "q6_k": 512, "int8": 357, "int4_g32": 357,
             "int4_g64": 357, "int4_g128": 357}  # fmt: skip
    packed = [(packed_weight(g, f, 37, shape.get(f, 352)), f, shape.get(f, 352)) for f in FORMATS]
    script = (
        "import sys, torch\n" + inspect.getsource(_int8_rows) + "\n"
        "x, packed = torch.load(sys.argv[1])\n"
        "torch.save(_int8_rows(x, packed), sys.argv[2])\n"
    )
    forms = {
        "this CPU's form": _int8_rows(x, packed),
        "AVX2 form": _run_avx2(tmp_path, script, (x, packed)),
    }
    for name, results in forms.items():
        for (_, f, k), (alone, full) in zip(packed, results, strict=True):
            for m, got in enumerate(full, start=1):
                for i in range(m):
                    assert torch.equal(got[i : i + 1], alone[i]), (name, f, k, m, i)
    # the forms differ only in fp32 summation order: both near the reference; the
    # K-quants' forms differ in one instruction (vpdpbusd or maddubs / madd, the same
    # int32 lanes): bitwise the same sums
    for (q, f, k), here, avx2 in zip(
        packed, forms["this CPU's form"], forms["AVX2 form"], strict=True
    ):
        if f in ("q4_k", "q5_k", "q6_k"):
            assert torch.equal(here[1][-1], avx2[1][-1]), f
        ref = reference.linear_q(x[:, :k].contiguous(), q, f, int8_activations=True)
        terms = (
            quantize_activations(x[:, :k], activation_group(f)).abs() @ dequantize(q, f, k).abs().T
        )
        for got in (here[1][-1], avx2[1][-1]):
            assert ((got - ref).abs() <= 1e-5 + 4e-7 * k**0.5 * terms).all(), f


_AVX2_GEMM_SCRIPT = """
import sys, torch, torch_topg
x, packed = torch.load(sys.argv[1])
out = [torch_topg.ops.linear_q(x[:m, :k].contiguous(), q, f, int8_activations=True)
       for q, f, k in packed for m in (8, 16, 33)]
torch.save(out, sys.argv[2])
"""


@requires_kernel("linear_q")
def test_int8_gemm_avx2_form_matches_reference(tmp_path):
    """The AVX2 form of the integer GEMM (gemm_q8_avx2.h: 8 weight rows per ymm, maddubs
    / madd, taken from 8 rows on CPUs without VNNI, not for q8_0 / int8) in a subprocess
    with TOPG_DISABLE_AVX512=1: near the reference at M = 8, 16 and 33, and each row the
    same at every M (a GEMM row's sum does not depend on M). N = 37: groups of 8 and a
    last group of 5; the 4-, 5- and 6-bit formats, int4 rows ending inside a group, two
    K-quant super-blocks (q6_k: scale blocks of 16)."""

    g = Gen("cpu", seed=51)
    x = g.randn(33, 600) * 2
    cases = [("q4_0", 320), ("q4_1", 96), ("q5_0", 288), ("q5_1", 320), ("int4_g32", 357),
             ("int4_g64", 357), ("int4_g128", 600), ("q4_k", 512), ("q5_k", 512), ("q6_k", 512)]  # fmt: skip
    packed = [(packed_weight(g, f, 37, k), f, k) for f, k in cases]
    avx2 = iter(_run_avx2(tmp_path, _AVX2_GEMM_SCRIPT, (x, packed)))
    for q, f, k in packed:
        got = {m: next(avx2) for m in (8, 16, 33)}
        xs = x[:, :k].contiguous()
        _assert_int8_close(
            got[33], reference.linear_q(xs, q, f, int8_activations=True), xs, q, f, k
        )
        assert torch.equal(got[8], got[33][:8]) and torch.equal(got[16], got[33][:16]), f
