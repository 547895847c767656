"""linear against its reference: every path (GEMV, small-M dot, packed GEMM) and tail."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference

# M crosses the dot / packed threshold (16) and the 6-row tiles; K and N cover the
# 8-lane and 16-column tails and K blocks of 256 (partial sums across blocks).
ROWS = st.sampled_from([1, 2, 3, 7, 16, 17, 64, 257])
SIZES = st.sampled_from([1, 7, 33, 100, 257, 1000]) | st.integers(1, 300)


def _scale(k: int) -> float:
    """fp32 tolerance widening: rounding error of a k-term sum grows like sqrt(k)."""
    return max(1.0, k**0.5 / 8)


def _inputs(lead: tuple[int, ...], k: int, n: int, dtype: torch.dtype, bias: bool):
    x = torch.randn(*lead, k, dtype=dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)  # outputs of order 1 for any K
    b = torch.randn(n, dtype=dtype) if bias else None
    return x, w, b


@requires_kernel("linear")
@given(m=ROWS, k=SIZES, n=SIZES, dtype=st.sampled_from(DTYPES), bias=st.booleans())
@example(m=1, k=1000, n=257, dtype=torch.float32, bias=True)  # GEMV with a row tail
@example(m=17, k=257, n=33, dtype=torch.float16, bias=False)  # packed, 2 K blocks
@example(m=257, k=1000, n=100, dtype=torch.bfloat16, bias=True)  # packed, 4 K blocks
@example(m=16, k=7, n=1, dtype=torch.bfloat16, bias=True)  # dot path, K below one vector
@example(m=64, k=1, n=1000, dtype=torch.float32, bias=False)
def test_linear(m, k, n, dtype, bias):
    x, w, b = _inputs((m,), k, n, dtype, bias)
    assert_close(torch_topg.ops.linear(x, w, b), reference.linear(x, w, b), scale=_scale(k))


@requires_kernel("linear")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead", [(2, 3), (4, 1, 5), (2, 20)])
def test_linear_batched_non_contiguous(lead, dtype):
    x, w, b = _inputs(lead, 40, 24, dtype, True)
    x_nc = x.transpose(0, -2) if len(lead) > 1 else x  # any layout is accepted
    assert not x_nc.is_contiguous()
    out = torch_topg.ops.linear(x_nc, w, b)
    assert out.shape == (*x_nc.shape[:-1], 24)
    assert_close(out, reference.linear(x_nc, w, b))


@requires_kernel("linear")
def test_linear_matches_f_linear():
    x, w, b = _inputs((5, 33), 100, 70, torch.float32, True)
    assert_close(torch_topg.ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))


@requires_kernel("linear")
def test_linear_empty():
    w = torch.randn(5, 0)
    b = torch.randn(5)
    assert_close(torch_topg.ops.linear(torch.randn(3, 0), w, b), b.expand(3, 5))
    assert torch_topg.ops.linear(torch.randn(0, 4), torch.randn(5, 4)).shape == (0, 5)


def test_linear_opcheck():
    for m in (1, 20):
        x, w, b = _inputs((m,), 40, 24, torch.float32, True)
        torch.library.opcheck(torch.ops.topg.linear.default, (x, w, b))
        torch.library.opcheck(torch.ops.topg.linear.default, (x, w, None))


def test_linear_compile_fullgraph():
    def mlp(x, w1, b1, w2):
        return torch_topg.ops.linear(torch.relu(torch_topg.ops.linear(x, w1, b1)), w2)

    x, w1, b1 = _inputs((2, 9), 48, 64, torch.float32, True)
    w2 = torch.randn(32, 64) / 8
    expected = mlp(x, w1, b1, w2)
    got = torch.compile(mlp, fullgraph=True, backend="aot_eager")(x, w1, b1, w2)
    assert_close(got, expected)


BAD = [
    (
        (torch.randn(4, 8), torch.randn(5, 8).half(), None),
        "argument 'weight'.*expected dtype float32",
    ),
    ((torch.randn(4, 8), torch.randn(5, 7), None), "argument 'weight'.*expected size 8 at dim 1"),
    ((torch.randn(4, 8), torch.randn(8, 5).t(), None), "argument 'weight'.*contiguous"),
    ((torch.randn(4, 8), torch.randn(5, 8), torch.randn(4)), "argument 'bias'.*size 5 at dim 0"),
    ((torch.randn(4, 8), torch.randn(5, 8), torch.randn(1, 5)), "argument 'bias'.*1 dimensions"),
    ((torch.randint(0, 3, (4, 8)), torch.randn(5, 8), None), "argument 'input'.*expected dtype"),
    ((torch.randn(4, 8), torch.randn(5, 8, 1), None), "argument 'weight'.*2 dimensions"),
]


@pytest.mark.parametrize("args, match", BAD)
def test_linear_bad_input(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.linear(*args)
    with pytest.raises(RuntimeError, match=match):  # the fake kernel checks the same
        with torch._subclasses.FakeTensorMode() as mode:
            torch_topg.ops.linear(*(None if a is None else mode.from_tensor(a) for a in args))


_SPLIT_SCRIPT = """
import sys, torch, torch_topg
from torch_topg import modes
cases = torch.load(sys.argv[1])
out = [[torch_topg.ops.linear(x[:m], w, b) for m in range(1, x.shape[0] + 1)]
       for x, w, b in cases]
torch.save((modes.cpu_kernels(), out), sys.argv[2])
"""


@requires_kernel("linear")
def test_bf16_split_form_matches_reference(tmp_path):
    """The bf16 GEMV of AVX-512 CPUs without AVX-512 BF16 (gemv_bf16split.h: 32 bf16
    weights split into their even and odd halves as fp32, tiles of 4 weight rows x 4 A
    rows), forced in a subprocess on any AVX-512 CPU (TOPG_DISABLE_AVX512_BF16=1,
    TOPG_DISABLE_AMX=1): near the reference at 1-16 rows, and each row bitwise the same at
    every row count (the one-row step's logits equal a verify step's). K: below one
    vector, not a multiple of 32 (the masked tail), several tails; N: groups of 4 and
    their remainders."""
    import os
    import subprocess
    import sys

    from torch_topg import modes

    if "avx512" not in modes.cpu_kernels():
        pytest.skip("the CPU has no AVX-512F (or TOPG_DISABLE_AVX512 is set)")
    g = torch.Generator().manual_seed(7)
    cases = []
    for k, n, bias in [(7, 5, True), (32, 4, False), (33, 9, False), (100, 37, True),
                       (576, 6, False), (2100, 13, True)]:  # fmt: skip
        x = torch.randn(16, k, generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.bfloat16)
        b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
        cases.append((x, w, b))
    inp, res, script = tmp_path / "in.pt", tmp_path / "out.pt", tmp_path / "split.py"
    script.write_text(_SPLIT_SCRIPT)
    torch.save(cases, inp)
    env = {**os.environ, "TOPG_DISABLE_AVX512_BF16": "1", "TOPG_DISABLE_AMX": "1"}
    subprocess.run([sys.executable, str(script), str(inp), str(res)], env=env, check=True,
                   cwd=tmp_path, timeout=300)  # fmt: skip
    kernels, out = torch.load(res, weights_only=False)
    assert "avx512_bf16split" in kernels, kernels
    for (x, w, b), per_m in zip(cases, out, strict=True):
        k = x.shape[1]
        assert_close(per_m[-1], reference.linear(x, w, b), scale=_scale(k))
        for m, got in enumerate(per_m, start=1):
            assert torch.equal(got, per_m[-1][:m]), f"K={k}: rows of a {m}-row call"


_PACKED_SCRIPT = """
import sys, torch, torch_topg
from torch_topg import modes
cases = torch.load(sys.argv[1])
torch.save((modes.cpu_kernels(), [torch_topg.ops.linear(x, w, b) for x, w, b in cases]),
           sys.argv[2])
"""


@requires_kernel("linear")
def test_packed_gemm_16_lane_kernel_bitwise_the_8_lane_one(tmp_path):
    """The packed GEMM's AVX-512 micro-kernel (gemm_f32x16.h: two 6-row tiles x two
    16-column panels) against the 8-lane 6 x 16 one (TOPG_DISABLE_AVX512=1), each in a
    subprocess (AVX-512 BF16 and AMX off, so bf16 takes the packed path too): every sum
    the same bits. Rows: an odd tile count, a lone tile, tile pairs; N: an odd panel count
    and partial panels; K: one K block, several with a tail (partial sums)."""
    import os
    import subprocess
    import sys

    from torch_topg import modes

    if "avx512" not in modes.cpu_kernels():
        pytest.skip("the CPU has no AVX-512F (or TOPG_DISABLE_AVX512 is set)")
    g = torch.Generator().manual_seed(11)
    cases = []
    for m, k, n, dtype, bias in [
        (17, 1, 16, torch.float32, False), (18, 257, 33, torch.float32, True),
        (30, 1000, 100, torch.bfloat16, True), (64, 300, 48, torch.float16, False),
        (257, 520, 129, torch.bfloat16, False), (40, 64, 7, torch.float32, True),
    ]:  # fmt: skip
        x = torch.randn(m, k, generator=g).to(dtype)
        w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
        cases.append((x, w, b))
    inp = tmp_path / "in.pt"
    script = tmp_path / "packed.py"
    script.write_text(_PACKED_SCRIPT)
    torch.save(cases, inp)
    outs = []
    base = {**os.environ, "TOPG_DISABLE_AVX512_BF16": "1", "TOPG_DISABLE_AMX": "1"}
    for extra in ({}, {"TOPG_DISABLE_AVX512": "1"}):
        res = tmp_path / f"out{len(outs)}.pt"
        subprocess.run([sys.executable, str(script), str(inp), str(res)], env={**base, **extra},
                       check=True, cwd=tmp_path, timeout=300)  # fmt: skip
        outs.append(torch.load(res, weights_only=False))
    (k16, wide), (k8, narrow) = outs
    assert "avx512" in k16 and "avx512" not in k8, (k16, k8)
    for (x, w, b), got, want in zip(cases, wide, narrow, strict=True):
        assert_close(got, reference.linear(x, w, b), scale=_scale(x.shape[1]))
        assert torch.equal(got, want), f"M={x.shape[0]} K={x.shape[1]} N={w.shape[0]} {x.dtype}"
