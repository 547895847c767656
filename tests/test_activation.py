"""silu_and_mul and gelu_and_mul against their references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference

shapes = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 200))


@requires_kernel("silu_and_mul")
@given(shape=shapes, dtype=st.sampled_from(DTYPES))
@example(shape=(1, 1, 1536), dtype=torch.bfloat16)
@example(shape=(3, 2, 13), dtype=torch.float16)
def test_silu_and_mul(shape, dtype):
    x = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype) * 4
    assert_close(torch_topg.ops.silu_and_mul(x), reference.silu_and_mul(x))


@requires_kernel("gelu_and_mul")
@given(shape=shapes, dtype=st.sampled_from(DTYPES), approximate=st.sampled_from(["none", "tanh"]))
@example(shape=(2, 1, 7), dtype=torch.float32, approximate="none")
def test_gelu_and_mul(shape, dtype, approximate):
    x = torch.randn(*shape[:-1], 2 * shape[-1], dtype=dtype) * 4
    assert_close(
        torch_topg.ops.gelu_and_mul(x, approximate), reference.gelu_and_mul(x, approximate)
    )


@requires_kernel("silu_and_mul")
def test_silu_and_mul_extremes_and_strided_rows():
    x = torch.tensor([[-100.0, -10.0, 0.0, 10.0, 100.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    assert_close(torch_topg.ops.silu_and_mul(x), reference.silu_and_mul(x))
    big = torch.randn(16, 64)
    view = big[:, :48]  # rows of a larger buffer: stride 64, width 48
    assert_close(torch_topg.ops.silu_and_mul(view), reference.silu_and_mul(view))


def test_reference_matches_torch_composition():
    x = torch.randn(3, 20, dtype=torch.float64).float()
    g, u = x.chunk(2, -1)
    torch.testing.assert_close(reference.silu_and_mul(x), F.silu(g) * u)


def test_activation_opcheck_and_compile():
    x = torch.randn(3, 5, 32)
    torch.library.opcheck(torch.ops.topg.silu_and_mul.default, (x,))
    torch.library.opcheck(torch.ops.topg.gelu_and_mul.default, (x, "tanh"))

    def mlp(h):
        return torch_topg.ops.silu_and_mul(h) + torch_topg.ops.gelu_and_mul(h)

    got = torch.compile(mlp, fullgraph=True, backend="aot_eager")(x)
    assert_close(got, mlp(x))


def test_activation_bad_input():
    with pytest.raises(RuntimeError, match="argument 'input'.*even last dimension"):
        torch_topg.ops.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(RuntimeError, match="argument 'input'.*expected dtype"):
        torch_topg.ops.silu_and_mul(torch.ones(2, 8, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="argument 'approximate'"):
        torch_topg.ops.gelu_and_mul(torch.randn(2, 8), "fast")
    with (
        pytest.raises(RuntimeError, match="argument 'input'.*even last dimension"),
        torch._subclasses.FakeTensorMode(),
    ):
        torch_topg.ops.silu_and_mul(torch.empty(2, 7))
