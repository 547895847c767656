"""transformers models under ``torch.compile(backend="topg")``: logits match eager in
prefill and decode (with a KV cache), every pattern site is replaced, no graph breaks,
bounded recompiles, weights resident once; SmolLM2 with its real weights generates the
same 32 tokens as eager."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from compile_utils import all_replaced

from torch_topg.bench.models import weights_bytes
from torch_topg.compile import REPORTS, clear_reports
from torch_topg.models import build_model, load_smollm2, smollm2_available

pytest.importorskip("transformers")

# Each model's patterns (all must be fully replaced).
PATTERNS = {
    "llama-tiny": ["attention", "rotary", "rms_norm", "add_rms_norm", "mlp", "linear"],
    "qwen2-tiny": ["attention", "rotary", "rms_norm", "add_rms_norm", "mlp", "linear"],
    "mixtral-tiny": ["attention", "rotary", "rms_norm", "add_rms_norm", "moe_router", "linear"],
    "qwen2moe-tiny": ["attention", "rotary", "rms_norm", "add_rms_norm", "moe_router", "mlp"],
}


def _prefill_decode(model, ids, steps=2):
    """Logits of a prefill and of ``steps`` decode steps with a DynamicCache."""
    logits = []
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        logits.append(out.logits)
        cache = out.past_key_values
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.past_key_values
            nxt = out.logits[:, -1:].argmax(-1)
    return logits


def _compiled(model):
    torch._dynamo.reset()
    clear_reports()
    return torch.compile(model, backend="topg")


CASES = [
    ("llama-tiny", None),
    ("qwen2-tiny", None),
    ("mixtral-tiny", "grouped_mm"),
    ("mixtral-tiny", "batched_mm"),
    ("mixtral-tiny", "eager"),
    ("qwen2moe-tiny", "grouped_mm"),
]


@pytest.mark.parametrize(("preset", "experts"), CASES)
def test_fp32_matches_eager(preset, experts):
    kw = {"experts_implementation": experts} if experts else {}
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    expected = _prefill_decode(build_model(preset, **kw), ids)
    actual = _prefill_decode(_compiled(build_model(preset, **kw)), ids)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    sites = [s for r in REPORTS for s in r.sites]
    for p in PATTERNS[preset]:
        all_replaced(sites, p)
    if "moe_router" in PATTERNS[preset]:  # the experts are fused_moe, whatever the impl
        assert all(r.topg_ops.get("fused_moe") == 2 for r in REPORTS), [r.topg_ops for r in REPORTS]
    torch._dynamo.reset()


@pytest.mark.parametrize("preset", ["llama-tiny", "mixtral-tiny"])
def test_bf16_within_tolerance_of_fp32(preset):
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(2))
    ref = _prefill_decode(build_model(preset, torch.float32), ids)
    eager = _prefill_decode(build_model(preset, torch.bfloat16), ids)
    topg = _prefill_decode(_compiled(build_model(preset, torch.bfloat16)), ids)
    for r, e, t in zip(ref, eager, topg, strict=True):
        err_topg = (t.float() - r).abs().max().item()
        err_eager = (e.float() - r).abs().max().item()
        # bf16 tolerance: no worse than eager bf16's own error (with slack), and small
        assert err_topg <= max(2 * err_eager, 2e-2), (err_topg, err_eager)
    torch._dynamo.reset()


def test_mixtral_eager_experts_no_graph_break():
    """The eager experts loop would break the graph; substituted, it does not."""
    model = build_model("mixtral-tiny", experts_implementation="eager")
    ids = torch.randint(0, 256, (1, 5))
    import torch_topg

    ex = torch_topg.explain(model, input_ids=ids, use_cache=False)
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.summary()
    assert ex.fused_moe_calls == 2
    counts = ex.counts()
    assert counts["moe_router"] == (2, 2) and counts["attention"] == (2, 2)


def test_recompiles_bounded():
    """3 prompt lengths x 20 decode steps: at most 2 recompiles (3 graphs)."""
    model = _compiled(build_model("llama-tiny"))
    with torch.inference_mode():
        for length in (5, 9, 13):
            ids = torch.randint(0, 256, (1, length))
            out = model(input_ids=ids, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(20):
                out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
                cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    assert len(REPORTS) <= 3, len(REPORTS)
    torch._dynamo.reset()


def test_fused_weights_resident_once():
    model = build_model("llama-tiny")
    before = weights_bytes(model)
    _prefill_decode(_compiled(model), torch.randint(0, 256, (1, 4)), steps=1)
    assert weights_bytes(model) == before
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == (
        attn.v_proj.weight.untyped_storage().data_ptr()
    )
    torch._dynamo.reset()


def test_backend_found_without_import():
    """The entry point registers the backend in a fresh process."""
    code = (
        "import sys, torch; assert 'topg' in torch._dynamo.list_backends(); "
        "f = torch.compile(lambda x: x * 2, backend='topg'); "
        "assert f(torch.ones(3)).sum().item() == 6; "
        "assert 'torch_topg' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


# --- SmolLM2 with real weights ----------------------------------------------------------
smollm2 = pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available()))


@smollm2
def test_smollm2_greedy_identical_fp32():
    """32 greedy tokens with the real weights: identical to eager in fp32; every site
    replaced; decode logits match."""
    model, tok = load_smollm2(torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    enc = tok.apply_chat_template(
        msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.inference_mode():
        expected = model.generate(**enc, max_new_tokens=32, do_sample=False)
    torch._dynamo.reset()
    clear_reports()
    # generate() calls self.forward: compile that (transformers' documented way).
    model.forward = torch.compile(model.forward, backend="topg")
    with torch.inference_mode():
        actual = model.generate(**enc, max_new_tokens=32, do_sample=False)
    assert torch.equal(actual, expected), (tok.decode(actual[0]), tok.decode(expected[0]))
    sites = [s for r in REPORTS for s in r.sites]
    for p in ("attention", "rotary", "rms_norm", "add_rms_norm", "mlp", "linear"):
        all_replaced(sites, p, at_least=30)
    torch._dynamo.reset()


@smollm2
def test_smollm2_bf16_logits():
    """bf16 compiled logits against fp32 eager: within 0.03 relative, or within twice the
    error of torch's own bf16 eager run where that is larger (this prompt's decode step
    sits near a point where bf16 rounding order is amplified: eager bf16 0.022, topg
    0.011 with AVX2 GEMVs and 0.038 with AVX-512 BF16 ones, measured 2026-12-01)."""
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(3))
    ref = _prefill_decode(load_smollm2(torch.float32)[0], ids, steps=1)
    eager = _prefill_decode(load_smollm2(torch.bfloat16)[0], ids, steps=1)
    out = _prefill_decode(_compiled(load_smollm2(torch.bfloat16)[0]), ids, steps=1)
    for r, e, o in zip(ref, eager, out, strict=True):
        rel = ((o.float() - r).norm() / r.norm()).item()
        rel_eager = ((e.float() - r).norm() / r.norm()).item()
        assert rel < max(0.03, 2 * rel_eager), (rel, rel_eager)
    torch._dynamo.reset()


if os.environ.get("TOPG_DISABLE_NATIVE") == "1":  # the reference fallback is slow for 30 layers
    test_smollm2_bf16_logits = pytest.mark.skip(
        reason="native kernels disabled (TOPG_DISABLE_NATIVE=1): bf16 SmolLM2 on the references is too slow for CI"
    )(test_smollm2_bf16_logits)


def _small(cls_name: str, **extra):
    import transformers

    base = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return getattr(transformers, cls_name)(**base, **extra)


@pytest.mark.parametrize(
    ("cls_name", "extra", "fused_norms"),
    [
        ("MistralConfig", {"sliding_window": 4}, True),
        ("Qwen3Config", {"head_dim": 16}, True),  # q/k RMSNorm before rotary
        ("GemmaConfig", {"head_dim": 16}, False),  # (1 + w) norm weight, gelu-tanh MLP
        ("Olmo2Config", {}, False),  # post-norm: no residual-add + norm to fuse
        (
            "Qwen3MoeConfig",
            {
                "moe_intermediate_size": 32,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "head_dim": 16,
            },
            True,
        ),
    ],
)
def test_more_architectures(cls_name, extra, fused_norms):
    """Other transformers families: logits match eager, no pass fails, the patterns
    each family has are replaced (and what is left alone says why)."""
    import transformers

    cfg = _small(cls_name, **extra)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(4))
    expected = _prefill_decode(ref, ids)
    actual = _prefill_decode(_compiled(model), ids)
    for e, a in zip(expected, actual, strict=True):
        torch.testing.assert_close(a, e, atol=1e-4, rtol=1e-4)
    assert not [e for r in REPORTS for e in r.errors]
    sites = [s for r in REPORTS for s in r.sites]
    for p in ("attention", "rotary", "rms_norm", "linear"):
        all_replaced(sites, p)
    if fused_norms:
        all_replaced(sites, "add_rms_norm")
    else:
        assert all(not s.replaced and s.detail for s in sites if s.pattern == "add_rms_norm")
    torch._dynamo.reset()
