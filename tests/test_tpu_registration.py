"""The XLA dispatch-key registration of the ops with Pallas kernels (torch_topg.tpu).

Without torch_xla there are no XLA tensors; what can be tested here is: the dispatcher
holds an XLA kernel for each such op (and reaches it: ``redispatch`` to the XLA key with
CPU tensors), the TPU / no-TPU decision with an injected probe, the one-warning
reference path, the torch-side glue of the Pallas path run with the interpret backend,
and that ``import torch_topg`` needs neither JAX nor torch_xla.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from conftest import assert_close

import torch_topg
from torch_topg import reference, tpu
from torch_topg.ops._schemas import SCHEMAS

XLA = torch._C.DispatchKeySet(torch._C.DispatchKey.XLA)


@pytest.fixture
def no_tpu():
    tpu.set_probe(lambda: tpu.Probe(False, "injected: no TPU here"))
    yield
    tpu.set_probe(None)


def _samples(dtype: torch.dtype = torch.float32) -> dict[str, tuple[tuple, dict]]:
    """(args, kwargs) per Pallas op: small, with partial blocks and GQA."""
    g = torch.Generator().manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(dtype)

    kc, vc = r(9, 4, 2, 16), r(9, 4, 2, 16)
    bt = torch.randperm(9, generator=g)[:8].view(2, 4).int()
    logits = torch.randn(7, 6, generator=g)
    tw, ti = reference.moe_topk(logits, 2, renormalize=True)
    return {
        "rms_norm": ((r(5, 40), r(40), 1e-6), {}),
        "fused_add_rms_norm": ((r(5, 40), r(5, 40), r(40), 1e-6), {}),
        "attention": (
            (r(2, 11, 4, 16), r(2, 19, 2, 16), r(2, 19, 2, 16)),
            {"causal": True, "window_left": 7, "softcap": 5.0},
        ),
        "paged_attention": ((r(2, 4, 16), kc, vc, bt, torch.tensor([13, 0]).int()), {}),
        "moe_topk": ((logits.to(dtype), 2), {"scoring": "sigmoid", "renormalize": True}),
        "fused_moe": (
            (r(7, 24), (r(6, 40, 24) * 0.3).to(dtype), (r(6, 24, 20) * 0.3).to(dtype), tw, ti),
            {"activation": "silu"},
        ),
    }


def _run(fn, op: str, args: tuple, kwargs: dict):  # type: ignore[no-untyped-def]
    """Call ``fn`` (the op, its reference or its XLA kernel) on clones; return the outputs
    (for the in-place op: the mutated tensors)."""
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
    out = fn(*args, **kwargs)
    return (args[0], args[1]) if op == "fused_add_rms_norm" else out


def test_every_pallas_op_has_an_xla_kernel():
    assert set(tpu.PALLAS_OPS) <= set(SCHEMAS)
    for op in SCHEMAS:
        has = torch._C._dispatch_has_kernel_for_dispatch_key(f"topg::{op}", "XLA")
        assert has == (op in tpu.PALLAS_OPS), op  # the others keep the reference fallback
    tpu.register_xla()  # idempotent: a second registration would raise in the dispatcher


def test_no_tpu_runs_reference_with_one_warning(no_tpu):
    args, kwargs = _samples()["rms_norm"]
    op = torch.ops.topg.rms_norm.default
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = op.redispatch(XLA, *args, **kwargs)  # the dispatcher's XLA kernel
        op.redispatch(XLA, *args, **kwargs)
    msgs = [str(w.message) for w in caught if "topg::rms_norm" in str(w.message)]
    assert len(msgs) == 1 and "injected: no TPU here" in msgs[0]
    assert torch.equal(out, reference.rms_norm(*args))
    assert ("rms_norm", "xla") in torch_topg.ops._library.FALLBACKS_USED


@pytest.mark.parametrize("op", tpu.PALLAS_OPS)
def test_xla_kernel_without_tpu_matches_reference(no_tpu, op):
    args, kwargs = _samples()[op]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = _run(tpu._xla.xla_kernel(op), op, args, kwargs)
    want = _run(getattr(reference, op), op, args, kwargs)
    for a, b in zip(
        got if isinstance(got, tuple) else (got,),
        want if isinstance(want, tuple) else (want,),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_xla_kernel_checks_arguments_first(no_tpu):
    x, w = torch.randn(3, 8), torch.randn(7)
    with pytest.raises(RuntimeError, match="'weight'"):
        torch.ops.topg.rms_norm.default.redispatch(XLA, x, w, 1e-6)


def test_default_probe_without_torch_xla():
    try:
        import torch_xla  # noqa: F401
    except ImportError:
        p = tpu.default_probe()
        assert not p.pallas and "torch_xla" in p.reason
    else:  # pragma: no cover - the optional lane
        pytest.skip("torch_xla installed: the probe asks the PJRT device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", tpu.PALLAS_OPS)
def test_tpu_path_runs_pallas_glue(op, dtype):
    # With a TPU (injected) the XLA kernel runs the torch-side glue and the kernel's single
    # pallas_call through the backend; here the interpret backend stands in for torch_xla.
    pytest.importorskip("jax")
    pytest.importorskip("ml_dtypes")
    from torch_topg.tpu._bridge import InterpretBackend

    calls: list[str] = []

    class Recording(InterpretBackend):
        def call(self, fn, tensors, outs, **static):  # type: ignore[no-untyped-def]
            calls.append(fn.__name__)
            return super().call(fn, tensors, outs, **static)

    tpu.set_probe(lambda: tpu.Probe(True))
    tpu.set_backend(Recording())
    try:
        args, kwargs = _samples(dtype)[op]
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the Pallas path must not warn
            got = _run(tpu._xla.xla_kernel(op), op, args, kwargs)
    finally:
        tpu.set_probe(None)
        tpu.set_backend(None)
    assert calls, "the Pallas backend was not called"
    want = _run(getattr(reference, op), op, args, kwargs)
    for a, b in zip(
        got if isinstance(got, tuple) else (got,),
        want if isinstance(want, tuple) else (want,),
        strict=True,
    ):
        if b.dtype == torch.int32:
            assert torch.equal(a, b)
        else:
            assert a.dtype == b.dtype
            assert_close(a, b, scale=2.0)


def test_unsupported_arguments_fall_back_with_reason():
    tpu.set_probe(lambda: tpu.Probe(True))
    try:
        q = torch.randn(5, 2, 16)
        cu = torch.tensor([0, 2, 5]).int()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = tpu._xla.xla_kernel("attention")(q, q, q, cu_seqlens_q=cu, causal=True)
        assert any("cu_seqlens" in str(w.message) for w in caught)
        assert torch.equal(out, reference.attention(q, q, q, cu_seqlens_q=cu, causal=True))
        kc, vc = torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16)
        bt, sl = torch.arange(4).view(2, 2).int(), torch.tensor([5, 3]).int()
        pq = torch.randn(5, 4, 16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kernel = tpu._xla.xla_kernel("paged_attention")
            out = kernel(pq, kc, vc, bt, sl, cu_seqlens_q=cu)
        assert any("cu_seqlens_q" in str(w.message) for w in caught)
        want = reference.paged_attention(pq, kc, vc, bt, sl, cu_seqlens_q=cu)
        assert torch.equal(out, want)
        x = torch.randn(3, 8, dtype=torch.float16)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tpu._xla.xla_kernel("rms_norm")(x, torch.ones(8, dtype=torch.float16), 1e-6)
        assert any("float16" in str(w.message) for w in caught)
    finally:
        tpu.set_probe(None)


def test_import_without_jax_or_torch_xla():
    # A meta-path finder makes jax and torch_xla unimportable; torch_topg still imports,
    # registers the XLA kernels, and an XLA-key call runs the reference, saying why.
    code = textwrap.dedent(
        """
        import sys, warnings
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("jax", "jaxlib", "torch_xla"):
                    raise ModuleNotFoundError(f"blocked: {name}")
        sys.meta_path.insert(0, Block())
        import torch, torch_topg
        assert "jax" not in sys.modules and "torch_xla" not in sys.modules
        for op in torch_topg.tpu.PALLAS_OPS:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"topg::{op}", "XLA"), op
        ks = torch._C.DispatchKeySet(torch._C.DispatchKey.XLA)
        x, w = torch.randn(2, 8), torch.randn(8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = torch.ops.topg.rms_norm.default.redispatch(ks, x, w, 1e-6)
        assert torch.equal(out, torch_topg.reference.rms_norm(x, w, 1e-6))
        assert any("torch_xla is not importable" in str(m.message) for m in caught), caught
        assert not torch_topg.tpu.jax_available()
        try:
            torch_topg.tpu.kernels("norm")
        except ImportError as exc:
            print("kernels:", exc)
        print("ok")
        """
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "ok" in res.stdout and "blocked: jax" in res.stdout


def test_jax_api_runs_interpreted_off_tpu():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    from torch_topg.tpu import jax_api

    assert not jax_api.on_tpu()
    x, w = torch.randn(3, 16), torch.randn(16)
    out = jax_api.rms_norm(jnp.asarray(x.numpy()), jnp.asarray(w.numpy()), 1e-6)
    assert_close(torch.from_numpy(jax.device_get(out).copy()), reference.rms_norm(x, w, 1e-6))
