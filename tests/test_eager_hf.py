"""transformers integration: ``attn_implementation="topg"`` / ``experts_implementation="topg"``
and whole models under ``torch_topg.enable()`` against the same models without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import torch_topg
from torch_topg import _native

transformers = pytest.importorskip("transformers")
from torch_topg.models import build_model, load_smollm2, smollm2_available  # noqa: E402

needs_native = pytest.mark.skipif(
    not _native.is_loaded(),
    reason=f"enable() needs the native extension ({_native.missing_reason('cpu')})",
)

# Whole-model logits: fp32 differs only by summation order; bf16 by one rounding per op.
MODEL_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (0.1, 0.05)}


def ops_called(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


def interface_maps() -> tuple[dict, dict]:
    from transformers.integrations.moe import ExpertsInterface
    from transformers.modeling_utils import AttentionInterface

    return dict(AttentionInterface._global_mapping), dict(ExpertsInterface._global_mapping)


def ids_for(model, seq: int = 13, batch: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)


@pytest.fixture(autouse=True)
def _always_disabled_after():
    yield
    torch_topg.disable()


def test_topg_is_registered_in_both_interfaces():
    attn, experts = interface_maps()
    assert attn["topg"] is torch_topg.eager.hf.topg_attention_forward
    assert experts["topg"] is torch_topg.eager.hf.topg_experts_forward


def test_import_does_not_import_transformers_and_registers_later():
    code = textwrap.dedent(
        """
        import sys, torch_topg
        assert "transformers" not in sys.modules, "import torch_topg imported transformers"
        from transformers import AttentionInterface
        from transformers.integrations.moe import ExpertsInterface
        assert "topg" in AttentionInterface._global_mapping
        assert "topg" in ExpertsInterface._global_mapping
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


@pytest.mark.parametrize(
    "preset,experts",
    [
        ("llama-tiny", None),
        ("qwen2-tiny", None),
        ("mixtral-tiny", "eager"),
        ("qwen2moe-tiny", "eager"),
    ],
)
def test_topg_implementations_match_sdpa_and_eager(preset, experts):
    extra = {"experts_implementation": experts} if experts else {}
    ref = build_model(preset, torch.float32, attn_implementation="sdpa", **extra)
    extra = {"experts_implementation": "topg"} if experts else {}
    topg = build_model(preset, torch.float32, attn_implementation="topg", **extra)
    ids = ids_for(ref)
    with torch.inference_mode():
        expected = ref(ids).logits
        out: list[torch.Tensor] = []
        called = ops_called(lambda: out.append(topg(ids).logits))
    if _native.is_loaded():
        assert "topg::attention" in called
        assert ("topg::fused_moe" in called) == (experts is not None)
    torch.testing.assert_close(out[0], expected, atol=1e-4, rtol=1e-4)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "preset,attn",
    [
        ("llama-tiny", "sdpa"),
        ("llama-tiny", "eager"),
        ("mixtral-tiny", "sdpa"),
        ("qwen2moe-tiny", "eager"),
    ],
)
def test_models_under_enable_match_and_disable_restores(preset, attn, dtype):
    model = build_model(preset, dtype, attn_implementation=attn)
    ids = ids_for(model)
    maps_before = interface_maps()
    with torch.inference_mode():
        expected = model(ids).logits
        with torch_topg.enabled():
            out: list[torch.Tensor] = []
            called = ops_called(lambda: out.append(model(ids).logits))
        after = model(ids).logits
    assert {"topg::attention", "topg::rms_norm", "topg::linear"} <= called or (
        dtype == torch.float32 and {"topg::attention", "topg::rms_norm"} <= called
    )
    if "mixtral" in preset or "moe" in preset:
        assert "topg::fused_moe" in called
    atol, rtol = MODEL_TOL[dtype]
    torch.testing.assert_close(out[0], expected, atol=atol, rtol=rtol)
    assert interface_maps() == maps_before
    assert torch_topg.eager.status()["patched"] == []
    torch.testing.assert_close(after, expected, atol=0, rtol=0)


@needs_native
def test_module_classes_are_restored():
    from transformers.models.llama import modeling_llama as ml

    norm_fwd, attn_fwd = ml.LlamaRMSNorm.forward, ml.LlamaAttention.forward
    with torch_topg.enabled():
        patched = torch_topg.eager.status()["patched"]
        assert "transformers.models.llama.modeling_llama.LlamaRMSNorm.forward" in patched
        assert ml.LlamaRMSNorm.forward is not norm_fwd
    assert ml.LlamaRMSNorm.forward is norm_fwd and ml.LlamaAttention.forward is attn_fwd


@needs_native
def test_enable_keeps_training_gradients():
    model = build_model("llama-tiny", torch.float32).train()
    ids = ids_for(model, seq=7, batch=1)
    model(ids).logits.sum().backward()
    expected = model.model.layers[0].input_layernorm.weight.grad.clone()
    model.zero_grad()
    with torch_topg.enabled():
        model(ids).logits.sum().backward()
    got = model.model.layers[0].input_layernorm.weight.grad
    torch.testing.assert_close(got, expected)


SMOLLM2_SKIP = smollm2_available()


@needs_native
@pytest.mark.skipif(SMOLLM2_SKIP is not None, reason=str(SMOLLM2_SKIP))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_smollm2_prefill_and_decode_under_enable(dtype):
    from transformers import DynamicCache

    model, tok = load_smollm2(dtype)
    ids = tok("The capital of France is", return_tensors="pt").input_ids

    def run():
        cache = DynamicCache(config=model.config)
        logits = [model(ids, cache=cache, use_cache=True).logits[:, -1]]
        for _ in range(3):
            nxt = logits[-1].argmax(-1, keepdim=True)
            logits.append(model(nxt, cache=cache, use_cache=True).logits[:, -1])
        return torch.stack(logits)

    with torch.inference_mode():
        expected = run()
        with torch_topg.enabled():
            out = run()
    atol, rtol = MODEL_TOL[dtype]
    if dtype == torch.float32:
        assert torch.equal(out.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(out, expected, atol=atol * 10, rtol=rtol)
