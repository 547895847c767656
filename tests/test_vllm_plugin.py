"""The vLLM plugin's contract outside vLLM: its entry point, its switch, and that neither
``import torch_topg`` nor importing the plugin module imports vLLM (runs in every lane;
the plugin inside vLLM is tested by tests/vllm_lane in ``make vllm-test``)."""

from __future__ import annotations

import logging
import pathlib
import subprocess
import sys

import pytest

from torch_topg.integrations import vllm_plugin

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    from pip._vendor import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_entry_point_declared():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    target = meta["project"]["entry-points"]["vllm.general_plugins"]["topg"]
    assert target == "torch_topg.integrations.vllm_plugin:register"
    module, func = target.split(":")
    assert callable(getattr(sys.modules[module], func))


def test_importing_torch_topg_never_imports_vllm():
    code = (
        "import sys, torch_topg, torch_topg.compat.vllm, torch_topg.integrations.vllm_plugin\n"
        "import os; os.environ['TOPG_VLLM_PLUGIN'] = '0'\n"
        "torch_topg.integrations.vllm_plugin.register()\n"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "value, mode",
    [(None, "on"), ("1", "on"), ("", "on"), ("0", "off"), ("off", "off"), ("ALL", "all")],
)
def test_mode_from_environment(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv(vllm_plugin.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(vllm_plugin.ENV_VAR, value)
    assert vllm_plugin.mode() == mode


def test_bad_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv(vllm_plugin.ENV_VAR, "yes please")
    with pytest.raises(
        ValueError, match=r"TOPG_VLLM_PLUGIN='yes please': expected 1 \(default\), 0 or all"
    ):
        vllm_plugin.mode()


def test_fallback_is_logged_once_per_reason():
    # A handler of its own: once vLLM has configured logging, "vllm" does not propagate.
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append  # type: ignore[method-assign]
    logger, level = vllm_plugin.LOGGER, vllm_plugin.LOGGER.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for _ in range(3):
            vllm_plugin.log_fallback("TestLayer", "reason A")
        vllm_plugin.log_fallback("TestLayer", "reason B")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    messages = [r.getMessage() for r in records]
    assert messages == [
        "torch_topg: TestLayer runs vLLM's implementation: reason A",
        "torch_topg: TestLayer runs vLLM's implementation: reason B",
    ]
