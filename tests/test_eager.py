"""torch_topg.enable() / disable(): dispatcher interception of aten ops.

Every interception test compares with the stock aten result computed before enabling,
checks that topg actually ran (profiler) or, for the cases topg must not take, that it
did not, and that disable() restores the dispatch table exactly.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL

import torch_topg
from torch_topg import _native

ATEN_OPS = ["aten::scaled_dot_product_attention", "aten::rms_norm", "aten::linear"]

needs_native = pytest.mark.skipif(
    not _native.is_loaded(),
    reason=f"enable() needs the native extension ({_native.missing_reason('cpu')})",
)


def dumps() -> dict[str, str]:
    return {op: torch._C._dispatch_dump(op) for op in ATEN_OPS}


def topg_ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages() if e.key.startswith("topg::")}


@pytest.fixture(autouse=True)
def _always_disabled_after():
    yield
    torch_topg.disable()


@needs_native
def test_disable_restores_the_dispatch_table_exactly():
    before = dumps()
    torch_topg.disable()  # without enable: nothing happens
    assert dumps() == before
    torch_topg.enable()
    during = dumps()
    torch_topg.enable()  # idempotent
    assert dumps() == during
    for op in ATEN_OPS:
        assert "intercept.cpp" in during[op] and during[op] != before[op], op
    status = torch_topg.eager.status()
    assert status["enabled"] and "linear.CPU" in status["intercepted"]
    torch_topg.disable()
    assert dumps() == before
    assert not torch_topg.eager.status()["enabled"]


@needs_native
def test_enabled_context_nests_and_restores():
    before = dumps()
    with torch_topg.enabled():
        with torch_topg.enabled():
            assert torch_topg.eager.is_enabled()
        assert torch_topg.eager.is_enabled()  # the inner block did not disable
    assert not torch_topg.eager.is_enabled() and dumps() == before
    torch_topg.enable()
    with torch_topg.enabled():
        pass
    assert torch_topg.eager.is_enabled()  # was enabled before the block: stays enabled


@needs_native
def test_enable_disable_from_many_threads():
    before = dumps()

    def flip(n: int) -> None:
        for i in range(20):
            (torch_topg.enable if (i + n) % 2 else torch_topg.disable)()

    threads = [threading.Thread(target=flip, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch_topg.disable()
    assert dumps() == before


SDPA_CASES = {
    # name: (q shape, kv shape, kwargs)
    "decode_gqa": ((2, 8, 1, 64), (2, 2, 37, 64), dict(enable_gqa=True)),
    "prefill_causal": ((1, 4, 33, 32), (1, 4, 33, 32), dict(is_causal=True)),
    "float_mask": ((2, 4, 5, 16), (2, 4, 9, 16), dict(mask="float")),
    "bool_mask": ((2, 4, 5, 16), (2, 4, 9, 16), dict(mask="bool", scale=0.3)),
}


def _sdpa_inputs(case: str, dtype: torch.dtype):
    qs, ks, kw = SDPA_CASES[case]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g).to(dtype) for s in (qs, ks, ks))
    kw = dict(kw)
    mask = kw.pop("mask", None)
    if mask == "float":
        kw["attn_mask"] = torch.randn(qs[0], 1, qs[2], ks[2], generator=g).to(dtype)
    elif mask == "bool":
        m = torch.rand(qs[0], 1, qs[2], ks[2], generator=g) > 0.5
        m[..., 0] = True  # no fully masked row (SDPA gives NaN there: see the fallback test)
        kw["attn_mask"] = m
    return q, k, v, kw


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", sorted(SDPA_CASES))
def test_sdpa_runs_topg_and_matches(case, dtype):
    q, k, v, kw = _sdpa_inputs(case, dtype)
    expected = F.scaled_dot_product_attention(q, k, v, **kw)
    with torch_topg.enabled(), torch.no_grad():
        out: list[torch.Tensor] = []
        assert "topg::attention" in topg_ops_called(
            lambda: out.append(F.scaled_dot_product_attention(q, k, v, **kw))
        )
    atol, rtol = TOL[dtype]
    assert out[0].shape == expected.shape
    torch.testing.assert_close(out[0], expected, atol=atol * 4, rtol=rtol * 4)


@needs_native
@pytest.mark.parametrize(
    "what",
    ["dropout", "top_left_causal", "fully_masked_row", "neg_inf_row", "grad", "5d_query"],
)
def test_sdpa_falls_back_where_semantics_differ(what):
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    kw: dict = {}
    if what == "dropout":
        kw["dropout_p"] = 0.5
    elif what == "top_left_causal":
        kw["is_causal"] = True  # Sq=3 != Sk=5: torch aligns top-left, topg bottom-right
    elif what == "fully_masked_row":
        m = torch.ones(1, 1, 3, 5, dtype=torch.bool)
        m[0, 0, 1] = False
        kw["attn_mask"] = m
    elif what == "neg_inf_row":
        m = torch.zeros(1, 1, 3, 5)
        m[0, 0, 2] = float("-inf")
        kw["attn_mask"] = m
    elif what == "grad":
        q.requires_grad_(True)
    elif what == "5d_query":
        q, k, v = q[None], k[None], v[None]

    def run():
        torch.manual_seed(0)
        return F.scaled_dot_product_attention(q, k, v, **kw)

    expected = run()
    with torch_topg.enabled():
        out: list[torch.Tensor] = []
        assert "topg::attention" not in topg_ops_called(lambda: out.append(run()))
    torch.testing.assert_close(out[0], expected, equal_nan=True)
    if what == "grad":
        (g_topg,) = torch.autograd.grad(out[0].sum(), q)
        (g_ref,) = torch.autograd.grad(expected.sum(), q)
        torch.testing.assert_close(g_topg, g_ref)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_runs_topg_and_matches(dtype):
    x, w = torch.randn(3, 5, 96).to(dtype), torch.randn(96).to(dtype)
    expected = F.rms_norm(x, (96,), w, 1e-5)
    with torch_topg.enabled(), torch.inference_mode():
        out: list[torch.Tensor] = []
        assert "topg::rms_norm" in topg_ops_called(
            lambda: out.append(F.rms_norm(x, (96,), w, 1e-5))
        )
        # no weight / eps=None / two normalised dims: aten's own kernel
        for call in (
            lambda: F.rms_norm(x, (96,)),
            lambda: F.rms_norm(x, (96,), w),
            lambda: F.rms_norm(x, (5, 96), torch.ones(5, 96, dtype=dtype), 1e-5),
        ):
            assert not topg_ops_called(call)
    torch.testing.assert_close(out[0], expected, atol=TOL[dtype][0] * 2, rtol=TOL[dtype][1] * 2)


@needs_native
@pytest.mark.parametrize(
    "dtype,rows,n,routed",
    [
        (torch.float32, 1, 48, True),  # decode
        (torch.float32, 64, 48, False),  # in between: MKL
        (torch.float32, 128, 512, True),  # prefill, wide output
        (torch.float32, 128, 48, False),  # prefill, narrow output: MKL
        (torch.bfloat16, 64, 48, True),  # half precision: always topg
    ],
)
def test_linear_runs_topg_where_faster(dtype, rows, n, routed):
    x, w, b = torch.randn(rows, 80).to(dtype), torch.randn(n, 80).to(dtype), torch.randn(n)
    b = b.to(dtype)
    expected = F.linear(x, w, b)
    with torch_topg.enabled(), torch.no_grad():
        out: list[torch.Tensor] = []
        called = topg_ops_called(lambda: out.append(F.linear(x, w, b)))
    assert ("topg::linear" in called) == routed
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out[0], expected, atol=atol * 10, rtol=rtol * 4)


@needs_native
def test_nn_linear_training_still_gets_gradients():
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(2, 16)
    lin(x).sum().backward()
    expected = lin.weight.grad.clone()
    lin.weight.grad = None
    with torch_topg.enabled():
        lin(x).sum().backward()
    torch.testing.assert_close(lin.weight.grad, expected)


@pytest.mark.skipif(_native.is_loaded(), reason="checks the run without native kernels")
def test_enable_without_native_says_why_and_changes_nothing():
    before = dumps()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch_topg.enable()
    assert not torch_topg.eager.is_enabled()
    assert dumps() == before
    assert "native extension" in str(torch_topg.eager.status()["unavailable"])
    msgs = [str(c.message) for c in caught]
    assert any("enable() does nothing" in m for m in msgs) or torch_topg.eager._state["warned"]
