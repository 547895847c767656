"""moe_topk against its reference."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference


def distinct_logits(tokens: int, experts: int, dtype: torch.dtype) -> torch.Tensor:
    # A random permutation of well-separated values: no ties after rounding to dtype.
    base = torch.linspace(-4, 4, experts)
    order = torch.rand(tokens, experts).argsort(dim=-1)
    return base[order].to(dtype)


@requires_kernel("moe_topk")
@given(
    tokens=st.integers(0, 50),
    experts=st.integers(1, 64),
    k=st.integers(1, 8),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    use_bias=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
@example(7, 8, 2, "softmax", True, False, torch.float32)  # Mixtral
@example(3, 64, 8, "sigmoid", True, True, torch.bfloat16)  # DeepSeek-V3 style
def test_moe_topk(tokens, experts, k, scoring, renormalize, use_bias, dtype):
    k = min(k, experts)
    logits = distinct_logits(tokens, experts, dtype)
    bias = torch.linspace(0.3, -0.3, experts)[torch.randperm(experts)] if use_bias else None
    kwargs = dict(scoring=scoring, renormalize=renormalize, correction_bias=bias)
    w, ids = torch_topg.ops.moe_topk(logits, k, **kwargs)
    w_ref, ids_ref = reference.moe_topk(logits, k, **kwargs)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    torch.testing.assert_close(ids, ids_ref, atol=0, rtol=0)
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)


@requires_kernel("moe_topk")
def test_moe_topk_ties_go_to_lower_index():
    logits = torch.zeros(2, 6)
    w, ids = torch_topg.ops.moe_topk(logits, 3)
    assert ids.tolist() == [[0, 1, 2], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 6))


def test_reference_matches_mixtral_router():
    logits = torch.randn(10, 8)
    w, ids = reference.moe_topk(logits, 2, renormalize=True)
    probs = logits.softmax(-1)
    top_w, top_i = probs.topk(2, dim=-1)
    torch.testing.assert_close(ids.long(), top_i)
    torch.testing.assert_close(w, top_w / top_w.sum(-1, keepdim=True))


def test_moe_topk_opcheck_and_compile():
    logits = torch.randn(9, 8)
    torch.library.opcheck(torch.ops.topg.moe_topk.default, (logits, 2), {"renormalize": True})
    f = lambda x: torch_topg.ops.moe_topk(x.float() * 2, 2, scoring="sigmoid")  # noqa: E731
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(logits)
    for a, b in zip(got, f(logits), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((torch.randn(4, 8), 9), {}, "argument 'top_k' expected a value in \\[1, 8\\]"),
        ((torch.randn(4, 8), 0), {}, "argument 'top_k'"),
        ((torch.randn(4, 8, 2), 2), {}, "argument 'router_logits'.*2 dimensions"),
        ((torch.randn(4, 8), 2), {"scoring": "relu"}, "argument 'scoring'"),
        ((torch.randn(4, 8), 2), {"correction_bias": torch.randn(7)}, "argument 'correction_bias'"),
    ],
)
def test_moe_topk_bad_input(args, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.moe_topk(*args, **kwargs)
