"""Every documented way in still imports and resolves (README, docs/architecture.md):
``backend="topg"`` through its entry point, ``torch_topg.ops.<op>``, the vLLM plugin's
entry function, ``torch_topg.enable``, ``torch_topg.Engine``, ``torch_topg.offload``
and ``torch_topg.parallel``."""

from __future__ import annotations

import importlib
import importlib.metadata
import pathlib
import subprocess
import sys

import pytest

import torch_topg

ROOT = pathlib.Path(__file__).resolve().parents[1]

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

META = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _resolve(target: str):
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


@pytest.mark.parametrize(
    ("group", "name"),
    [("torch_dynamo_backends", "topg"), ("vllm.general_plugins", "topg")],
)
def test_declared_entry_points_resolve(group, name):
    assert callable(_resolve(META["project"]["entry-points"][group][name]))


def test_console_script_resolves():
    assert callable(_resolve(META["project"]["scripts"]["torch-topg"]))


def test_backend_topg_without_importing_torch_topg():
    """``torch.compile(fn, backend="topg")`` finds the backend through the installed entry
    point; torch_topg is imported by dynamo, not by the caller."""
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    assert any(ep.name == "topg" for ep in eps), (
        "no torch_dynamo_backends entry point 'topg': install torch_topg (make test does)"
    )
    code = (
        "import sys, torch\n"
        "assert 'torch_topg' not in sys.modules\n"
        "fn = torch.compile(lambda x: torch.nn.functional.silu(x) * 2, backend='topg')\n"
        "x = torch.randn(4, 8)\n"
        "torch.testing.assert_close(fn(x), torch.nn.functional.silu(x) * 2)\n"
        "from torch._dynamo import lookup_backend\n"
        "import torch_topg.compile\n"
        "assert lookup_backend('topg') is torch_topg.compile.topg_backend\n"
        "print('ok', 'torch_topg' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok True"


@pytest.mark.parametrize("op", sorted(torch_topg.ops.OPS))
def test_ops_wrapper_per_op(op):
    assert callable(getattr(torch_topg.ops, op))
    assert torch_topg.ops.OPS[op].wrapper is getattr(torch_topg.ops, op)


def test_vllm_plugin_entry_function_without_vllm():
    from torch_topg.integrations.vllm_plugin import register

    assert callable(register)


def test_package_level_names():
    for name in ("enable", "disable", "enabled", "offload", "explain", "quantize"):
        assert callable(getattr(torch_topg, name)), name
    from torch_topg.engine import Engine

    assert torch_topg.Engine is Engine
    parallel = importlib.import_module("torch_topg.parallel")
    assert callable(parallel.tensor_parallel)
    assert callable(parallel.init_distributed)
