"""torch_topg.compat.vllm against the installed vLLM's own signatures, and the lane's
venv against vLLM's own requirements (``make vllm-test``)."""

from __future__ import annotations

import importlib
import inspect
from importlib.metadata import PackageNotFoundError, requires, version

import pytest
import vllm_utils  # noqa: F401  (picks vLLM's platform before vLLM is imported)

pytest.importorskip("vllm", reason="vllm is not installed (the vLLM lane: make vllm-test)")

from packaging.requirements import Requirement

from torch_topg.compat import vllm as compat

# Where vLLM 0.33 keeps each name that torch_topg.compat.vllm follows.
CURRENT = {
    "rms_norm": "vllm._custom_ops",
    "fused_add_rms_norm": "vllm._custom_ops",
    "rotary_embedding": "vllm._custom_ops",
    "reshape_and_cache": "vllm._custom_ops",
    "reshape_and_cache_flash": "vllm._custom_ops",
    "topk_softmax": "vllm._custom_ops",
    "fused_topk": "vllm.model_executor.layers.fused_moe.router.fused_topk_router",
    "fused_experts": "vllm.model_executor.layers.fused_moe.fused_moe",
}
# Older names kept for forks: gone from vLLM's Python API (docs/integrations.md).
REMOVED = {
    "silu_and_mul": "vllm._custom_ops",
    "gelu_and_mul": "vllm._custom_ops",
    "gelu_tanh_and_mul": "vllm._custom_ops",
    "paged_attention_v1": "vllm._custom_ops",
    "paged_attention_v2": "vllm._custom_ops",
    "fused_moe": "vllm.model_executor.layers.fused_moe.fused_moe",
}


def test_compat_covers_exactly_these_names():
    assert set(compat.__all__) == CURRENT.keys() | REMOVED.keys()


@pytest.mark.parametrize("name", sorted(CURRENT))
def test_signature_matches_installed_vllm(name):
    """Any call valid against vLLM's function binds to ours the same way: vLLM's
    parameters are ours, in the same order and kind; ours beyond them have defaults."""
    theirs = list(
        inspect.signature(getattr(importlib.import_module(CURRENT[name]), name)).parameters.values()
    )
    ours = list(inspect.signature(getattr(compat, name)).parameters.values())
    assert [(p.name, p.kind) for p in ours[: len(theirs)]] == [(p.name, p.kind) for p in theirs]
    for p in ours[len(theirs) :]:
        assert p.kind == p.VAR_KEYWORD or p.default is not p.empty, (name, p.name)
    for mine, vllms in zip(ours, theirs, strict=False):  # vLLM's defaults are ours
        if vllms.default is not vllms.empty:
            assert mine.default == vllms.default or mine.name == "activation", (name, mine.name)


@pytest.mark.parametrize("name", sorted(REMOVED))
def test_removed_from_installed_vllm(name):
    assert not hasattr(importlib.import_module(REMOVED[name]), name)


def test_venv_satisfies_vllm_requirements():
    """Every installed package vLLM requires is at a version vLLM accepts (the lane
    installs only what importing vLLM's layers needs: the others are absent)."""
    bad, checked = [], 0
    for line in requires("vllm") or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue
        checked += 1
        if not req.specifier.contains(installed, prereleases=True):
            bad.append(f"{req.name} {installed} (vllm needs {req.specifier})")
    assert version("vllm") == "0.33.0"
    assert checked >= 30 and not bad, bad
