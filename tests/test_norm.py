"""rms_norm and fused_add_rms_norm against their references."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference

shapes = st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 300))


@requires_kernel("rms_norm")
@given(shape=shapes, dtype=st.sampled_from(DTYPES), f32_weight=st.booleans())
@example(shape=(1, 1, 4096), dtype=torch.bfloat16, f32_weight=False)
@example(shape=(5, 3, 123), dtype=torch.float16, f32_weight=True)
@example(shape=(1, 1, 1), dtype=torch.float32, f32_weight=False)
def test_rms_norm(shape, dtype, f32_weight):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=torch.float32 if f32_weight else dtype)
    assert_close(torch_topg.ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


@requires_kernel("rms_norm")
def test_rms_norm_non_contiguous_input():
    x = torch.randn(64, 8, 96).transpose(0, 1)  # rows not contiguous
    w = torch.randn(96)
    assert_close(torch_topg.ops.rms_norm(x, w), reference.rms_norm(x, w, 1e-6))


@requires_kernel("fused_add_rms_norm")
@given(shape=shapes, dtype=st.sampled_from(DTYPES))
@example(shape=(1, 1, 576), dtype=torch.bfloat16)
@example(shape=(4, 3, 17), dtype=torch.float16)
def test_fused_add_rms_norm(shape, dtype):
    x, r = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.randn(shape[-1], dtype=dtype)
    x_ref, r_ref = x.clone(), r.clone()
    torch_topg.ops.fused_add_rms_norm(x, r, w, 1e-6)
    reference.fused_add_rms_norm(x_ref, r_ref, w, 1e-6)
    torch.testing.assert_close(r, r_ref, atol=0, rtol=0)  # the add is exact per element
    assert_close(x, x_ref)


def test_norm_opcheck():
    x, w = torch.randn(3, 5, 40), torch.randn(40)
    torch.library.opcheck(torch.ops.topg.rms_norm.default, (x, w, 1e-6))
    torch.library.opcheck(
        torch.ops.topg.fused_add_rms_norm.default, (x.clone(), torch.randn_like(x), w, 1e-6)
    )


def test_norm_compile_fullgraph():
    def block(x, r, w):
        y = torch_topg.ops.rms_norm(x, w)
        torch_topg.ops.fused_add_rms_norm(y, r, w)
        return y, r

    x, r, w = torch.randn(2, 7, 64), torch.randn(2, 7, 64), torch.randn(64)
    expected = block(x.clone(), r.clone(), w)
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(x.clone(), r.clone(), w)
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(4, 8), torch.randn(7)), "argument 'weight'.*expected size 8 at dim 0"),
        ((torch.randn(4, 8), torch.randn(2, 8)), "argument 'weight'.*expected 1 dimensions"),
        ((torch.randint(0, 3, (4, 8)), torch.randn(8)), "argument 'input'.*expected dtype float32"),
        ((torch.randn(4, 8), torch.randint(0, 3, (8,))), "argument 'weight'.*expected dtype"),
    ],
)
def test_rms_norm_bad_input(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.rms_norm(*args)
    with pytest.raises(RuntimeError, match=match):  # the fake kernel checks the same
        with torch._subclasses.FakeTensorMode() as mode:
            torch_topg.ops.rms_norm(*(mode.from_tensor(a) for a in args))


def test_fused_add_rms_norm_bad_input():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="argument 'residual'.*expected dtype float32"):
        torch_topg.ops.fused_add_rms_norm(x, torch.randn(4, 8).half(), w)
    with pytest.raises(RuntimeError, match="argument 'input'.*contiguous"):
        torch_topg.ops.fused_add_rms_norm(torch.randn(8, 4).t(), torch.randn(4, 8), w)
    with pytest.raises(RuntimeError, match="argument 'residual'"):
        torch_topg.ops.fused_add_rms_norm(x, torch.randn(4, 9), w)
