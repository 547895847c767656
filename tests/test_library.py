"""The op library as a whole: every schema has its pieces; the reference fallback works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_topg
from torch_topg import _native
from torch_topg.ops._registry import pending
from torch_topg.ops._schemas import SCHEMAS


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_op_has_wrapper_reference_fake(name):
    assert callable(getattr(torch_topg.ops, name)), f"torch_topg.ops.{name} missing"
    assert callable(getattr(torch_topg.reference, name)), f"torch_topg.reference.{name} missing"
    wrapper_doc = getattr(torch_topg.ops, name).__doc__ or ""
    assert "Args:" in wrapper_doc, f"torch_topg.ops.{name} needs a docstring with shapes"
    assert _native.has_kernel(name, "Meta"), f"topg::{name} has no fake kernel"
    assert _native.has_kernel(name, "CompositeExplicitAutograd"), f"topg::{name} no fallback"


@pytest.mark.skipif(not _native.is_loaded(), reason=f"native: {_native.missing_reason('cpu')}")
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_native_cpu_kernel_registered(name):
    _check_kernel(name, "CPU")


def _check_kernel(name: str, key: str) -> None:
    why = pending(name, key)
    if why is not None:
        assert not _native.has_kernel(name, key), (
            f"topg::{name} has a {key} kernel now: remove it from PENDING_KERNELS"
        )
        pytest.skip(f"topg::{name}: no {key} kernel yet ({why}); the reference runs")
    assert _native.has_kernel(name, key), f"topg::{name} has no {key} kernel"


def test_build_info_names_the_torch_it_was_built_for():
    if not _native.is_loaded():
        pytest.skip(f"native: {_native.missing_reason('cpu')}")
    info = _native.build_info()
    assert info["torch_version"].split("+")[0] == torch.__version__.split("+")[0]


def test_reference_fallback_without_native_extension():
    """With the extension disabled every op still runs (through its reference) and the
    fallback warns once per op and device."""
    script = textwrap.dedent(
        """
        import warnings
        import torch, torch_topg
        assert not torch_topg.native_available()
        x, w = torch.randn(4, 64), torch.randn(64)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = torch_topg.ops.rms_norm(x, w)
            b = torch_topg.ops.rms_norm(x, w)
            s = torch_topg.ops.silu_and_mul(x)
        torch.testing.assert_close(a, torch_topg.reference.rms_norm(x, w, 1e-6))
        torch.testing.assert_close(s, torch_topg.reference.silu_and_mul(x))
        msgs = [str(c.message) for c in caught if issubclass(c.category, RuntimeWarning)]
        assert len(msgs) == 2, msgs
        assert "topg::rms_norm has no native kernel" in msgs[0], msgs
        assert "TOPG_DISABLE_NATIVE" in msgs[0], msgs
        try:
            torch_topg.ops.rms_norm(x, torch.randn(3))
        except RuntimeError as e:
            assert "argument 'weight'" in str(e)
        else:
            raise AssertionError("bad input accepted by the fallback")
        print("ok")
        """
    )
    env = {**os.environ, "TOPG_DISABLE_NATIVE": "1"}
    env.pop("TOPG_REQUIRE_NATIVE", None)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.skipif(not _native.cuda_built(), reason="the native extension has no CUDA kernels")
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_native_cuda_kernel_registered(name):
    _check_kernel(name, "CUDA")


@pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only build of torch")
def test_loader_refuses_cuda_build_on_cpu_torch(tmp_path):
    """A library built with CUDA kernels links libtorch_cuda: on a CPU-only torch the
    loader must refuse it (with the reason) before trying, and fall back."""
    (tmp_path / "_C.so").write_bytes(b"not a library")
    info = {"torch_version": torch.__version__, "cpu_isa": "DEFAULT", "cuda": True}
    (tmp_path / "_build_info.json").write_text(json.dumps(info))
    script = (
        "import torch_topg; from torch_topg import _native; "
        "assert not _native.is_loaded(); print(_native.missing_reason('cuda'))"
    )
    env = {**os.environ, "TOPG_NATIVE_DIR": str(tmp_path)}
    env.pop("TOPG_REQUIRE_NATIVE", None)
    env.pop("TOPG_DISABLE_NATIVE", None)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "built with CUDA kernels" in out.stdout and "CPU-only torch" in out.stdout
