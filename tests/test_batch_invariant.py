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
    n=st.integers(36, 41),
)
def test_linear_dot_path_rows_independent_of_rows(dtype, k, n):
    """Without the mode, the dot path (up to 16 rows: decode and speculative verify steps)
    still gives each row the sums it gets alone, whatever kernel a row count takes (the
    one-row GEMV, the AVX2 passes of 3 rows (read from an interleaved copy of A from 4
    rows), the AVX2 tiles from 12 rows, the AVX-512 passes of up to 8 rows, the AVX-512
    BF16 dot products, whose tiles of 6 weight rows end in a tile of n mod 6 rows):
    a verify step's logits must equal the decode step's."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(16, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    fn = lambda a: torch_topg.ops.linear(a, w)  # noqa: E731
    alone = torch.cat([fn(x[i : i + 1]) for i in range(16)])
    for m in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16):
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


def _in_subprocess(tmp_path, script: str, payload, env: dict[str, str]):
    """Runs `script` (argv: an input and an output .pt file) on `payload` in a fresh
    process with `env` added to the environment; returns what it saved."""
    import os
    import subprocess
    import sys

    path, inp, out = tmp_path / "script.py", tmp_path / "in.pt", tmp_path / "out.pt"
    path.write_text(script)
    torch.save(payload, inp)
    subprocess.run([sys.executable, str(path), str(inp), str(out)], env={**os.environ, **env},
                   check=True, cwd=tmp_path, timeout=300)  # fmt: skip
    return torch.load(out, weights_only=False)


_AVX2_SCRIPT = """
import sys, torch, torch_topg
x, ws, packed = torch.load(sys.argv[1])
out = [torch_topg.ops.linear(x[:m, : w.shape[1]].contiguous(), w) for w in ws for m in (1, 2, 3, 8, 16)]
out += [torch_topg.ops.linear_q(x[:m, :k].contiguous(), q, f) for q, f, k in packed for m in (3, 8, 16)]
torch.save(out, sys.argv[2])
"""


def test_avx512_and_avx2_dot_paths_agree_bitwise(tmp_path):
    """The fp32 dot path (of 1-16 rows on Intel CPUs, 3-16 elsewhere) and linear_q's
    fp32-activation GEMV take an AVX-512F form where the CPU has it (gemv_avx512.h) and
    the AVX2 form elsewhere: both must give the same bits, so a model's outputs do not
    depend on the CPU's vector width. The AVX2 form runs in a subprocess with
    TOPG_DISABLE_AVX512=1 (on a CPU without AVX-512 both sides are AVX2 and the test still
    runs)."""
    from torch_topg.quant import quantize_weight

    g = torch.Generator().manual_seed(7)
    x = torch.randn(16, 1600, generator=g)
    ws = [torch.randn(21, k, generator=g) / k**0.5 for k in (576, 1536, 1000, 45, 7)]
    packed = [
        (quantize_weight(torch.randn(13, k, generator=g), fmt), fmt, k)
        for fmt, k in (("q4_1", 576), ("q8_0", 1536), ("int8", 1000), ("int4_g64", 576))
    ]
    theirs = _in_subprocess(tmp_path, _AVX2_SCRIPT, (x, ws, packed), {"TOPG_DISABLE_AVX512": "1"})
    ours = [
        torch_topg.ops.linear(x[:m, : w.shape[1]].contiguous(), w)
        for w in ws
        for m in (1, 2, 3, 8, 16)
    ]
    ours += [
        torch_topg.ops.linear_q(x[:m, :k].contiguous(), q, f)
        for q, f, k in packed
        for m in (3, 8, 16)
    ]
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert torch.equal(a, b), f"output {i} differs between the AVX-512 and AVX2 paths"


_NO_AMX_SCRIPT = """
import sys, torch, torch_topg
x, ws = torch.load(sys.argv[1])
out = [torch_topg.ops.linear(x[:m, : w.shape[1]].contiguous(), w) for w in ws for m in (1, 3, 16)]
torch.save((out, torch_topg.modes.cpu_kernels()), sys.argv[2])
"""


def test_amx_and_avx512_bf16_dot_paths_match_the_reference(tmp_path):
    """The bf16 dot path (1-16 rows) runs on AMX tiles where the CPU has them
    (gemv_amx.h) and on AVX-512 BF16 / AVX2 elsewhere. The sums run in different orders,
    so the paths differ within fp32 rounding of the sums before the output's bf16 rounding:
    both are compared with the products summed in float64 (the other path in a subprocess
    with TOPG_DISABLE_AMX=1; on a CPU without AMX both sides are the same path). The
    shapes cover K of whole 32-value tiles, a tail of 2-30 values, odd K (not on AMX) and
    weight rows that leave passes of 1-31 rows."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(16, 1600, generator=g).bfloat16()
    ws = [
        (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        for n, k in ((37, 576), (65, 1536), (16, 1000), (33, 62), (3, 2), (31, 45), (96, 64))
    ]
    theirs, their_kernels = _in_subprocess(
        tmp_path, _NO_AMX_SCRIPT, (x, ws), {"TOPG_DISABLE_AMX": "1"}
    )
    assert "amx_bf16" not in their_kernels
    i = 0
    for w in ws:
        for m in (1, 3, 16):
            a = x[:m, : w.shape[1]]
            exact = a.double() @ w.double().T
            ours = torch_topg.ops.linear(a.contiguous(), w)
            for name, got in (("this process", ours), ("TOPG_DISABLE_AMX=1", theirs[i])):
                # the exact sum rounded to bf16 is at most half a bf16 ulp away; the fp32
                # sums add a little more (K products of magnitude ~|a| |w|)
                tol = exact.abs() * 2**-8 + 1e-5 * w.shape[1] ** 0.5
                err = (got.double() - exact).abs()
                assert bool((err <= tol).all()), (
                    f"{name}: linear [{m}, {w.shape[1]}] x {list(w.shape)} off by {err.max():.3g}"
                )
            i += 1


def test_set_amx_switches_the_path_and_reports_it():
    from torch_topg import modes

    kernels = modes.cpu_kernels()
    assert kernels[0] == "avx2"
    if "amx_bf16" not in kernels:
        assert modes.set_amx(True) is False  # a CPU without AMX: nothing to switch
        return
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(3, 576, generator=g).bfloat16(), torch.randn(40, 576, generator=g).bfloat16()
    on = torch_topg.ops.linear(x, w)
    assert modes.set_amx(False) is True
    try:
        assert "amx_bf16" not in modes.cpu_kernels()
        off = torch_topg.ops.linear(x, w)
    finally:
        assert modes.set_amx(True) is False
    assert "amx_bf16" in modes.cpu_kernels()
    torch.testing.assert_close(on, off, rtol=2**-7, atol=1e-3)
