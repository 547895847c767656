"""The decode plan's MoE layers and probed features (docs/decode-step.md): Mixtral,
Qwen2-MoE (shared expert, dense layers between MoE ones), Qwen3-MoE and OLMoE (QK-norm
over the whole projection) decode steps as one native call, bitwise equal to the
compiled graph (router topg::linear, topg::moe_topk, topg::fused_moe / fused_moe_q) in
fp32 and bf16 at batch 1 and 8 and on verify steps; packed experts (GGUF formats, with
and without int8 activations) too; the engine's greedy text through the plan equals
transformers'; a feature the plan lacks is refused by name."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts, tiny
from test_decode_plan import (
    _compare_decode_and_verify,
    _engine_greedy_on_plan_equals_transformers,
    _model_runner,
)

from torch_topg import _native
from torch_topg.compile.decode_plan import Unsupported, lower
from torch_topg.engine.model_runner import ModelRunner

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not _native.load(),
    reason="native library not loaded (not built, or TOPG_DISABLE_NATIVE=1): the decode plan "
    "(csrc/cpu/decode_plan.cpp) has no reference fallback",
)

_ATTN = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)


def _build(cls_name: str, **kw) -> torch.nn.Module:
    """A seeded tiny transformers model of ``cls_name`` (weights as build_model sets them)."""
    import transformers

    cfg = getattr(transformers, cls_name)(**{**_ATTN, **kw})
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.uniform_(0.8, 1.2)
            else:
                p.data.normal_(0.0, 0.02 if p.dim() > 1 else 0.01)
    return model.eval()


def _family(name: str) -> torch.nn.Module:
    if name in ("mixtral-tiny", "qwen2moe-tiny"):
        return tiny(name)
    if name == "qwen2moe-mixed":  # a dense layer after an MoE layer, renormalised top-k
        return _build("Qwen2MoeConfig", hidden_size=64, intermediate_size=96,
                      moe_intermediate_size=64, shared_expert_intermediate_size=64,
                      num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                      norm_topk_prob=True)  # fmt: skip
    if name == "qwen3moe":
        return _build("Qwen3MoeConfig", hidden_size=64, intermediate_size=96, head_dim=16,
                      moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                      norm_topk_prob=True)  # fmt: skip
    if name == "olmoe":
        return _build("OlmoeConfig", hidden_size=64, intermediate_size=64, num_experts=8,
                      num_experts_per_tok=3)  # fmt: skip
    raise ValueError(name)


# (family, dtype): both dtypes for Mixtral (float32 router weights); OLMoE's whole-
# projection QK-norm in bf16 here and in fp32 by the packed OLMoE case below; one each for
# the others (the packed tests add fp32 Qwen2-MoE).
CASES = [("mixtral-tiny", torch.float32), ("mixtral-tiny", torch.bfloat16),
         ("olmoe", torch.bfloat16), ("qwen2moe-mixed", torch.bfloat16),
         ("qwen3moe", torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("family", "dtype"), CASES)
def test_moe_plan_equals_compiled_graph(family, dtype):
    r = _model_runner(_family(family).to(dtype))
    assert r.plan is not None, r.plan_reason
    _compare_decode_and_verify(r, 21, steps=8, verify=[[5, 6, 7, 8], [9, 10]])


def _packed(family: str, fmt: str, int8_activations: bool) -> torch.nn.Module:
    """``family`` with its experts as QuantizedExperts in ``fmt`` and every other linear
    (shared expert and its gate included) as a QuantizedLinear in q8_0."""
    from torch_topg.quant import QuantizedExperts, quantize

    model = _family(family)
    for layer in model.model.layers:
        mlp = layer.mlp
        if hasattr(mlp, "experts"):
            mlp.experts = QuantizedExperts.from_experts(mlp.experts, fmt, int8_activations)
    skip = [n for n, _ in model.named_modules() if n.endswith(".gate")]  # routers stay float
    return quantize(model, "q8_0", skip=skip, int8_activations=int8_activations, experts=False)


@pytest.mark.parametrize(
    ("family", "fmt", "a8", "dtype"),
    [("qwen2moe-mixed", "q8_0", False, torch.float32), ("mixtral-tiny", "q4_0", True, torch.bfloat16),
     ("olmoe", "q8_0", True, torch.float32)],
)  # fmt: skip
def test_packed_moe_plan_equals_compiled_graph(family, fmt, a8, dtype):
    """Experts packed in a GGUF format (fused_moe_q in the graph, its items in the plan),
    int8 activations rounding x and h to int8 blocks as the op does."""
    model = _packed(family, fmt, a8)
    r = _model_runner(model.to(dtype))
    assert r.plan is not None, r.plan_reason
    _compare_decode_and_verify(r, 23, steps=8, verify=[[5, 6, 7], [9, 10, 11, 12]])


def test_engine_greedy_through_the_plan_equals_transformers():
    """Alone and in a batch, fp32: the engine's decode steps run on the plan (asserted,
    not assumed) and its greedy tokens are transformers' generate. Qwen2-MoE with a dense
    layer after an MoE layer and a shared expert (whole-projection QK-norm through the
    engine: OLMo 2 in test_decode_plan_dense.py)."""
    model = _family("qwen2moe-mixed")
    ps = prompts(31, [5, 11, 3])
    _engine_greedy_on_plan_equals_transformers(model, ps)


def _runner_without_plan(model) -> ModelRunner:
    return ModelRunner(model, num_blocks=8, block_size=4, max_blocks_per_seq=4, compile=False)


def test_refusals_name_the_feature():
    """Probed, not listed: what the plan lacks is named, families are not."""
    m = _family("qwen3moe")
    m.config.clip_qkv = 8.0  # OLMo's clipping of q / k / v: a configuration feature
    r = _runner_without_plan(m)
    with pytest.raises(Unsupported, match=r"q / k / v clipping \(clip_qkv\) \(clip_qkv=8.0\)"):
        lower(r.model, r.kv_caches, block_size=4, max_positions=16)
    m.config.clip_qkv = None
    gate = m.model.layers[1].mlp.gate  # a router whose selection is biased (DeepSeek-V3 style)
    gate.e_score_correction_bias = torch.nn.Parameter(torch.zeros(gate.weight.shape[0]))
    r = _runner_without_plan(m)
    with pytest.raises(Unsupported, match=r"layers\.1\.mlp\.gate: router bias"):
        lower(r.model, r.kv_caches, block_size=4, max_positions=16)
