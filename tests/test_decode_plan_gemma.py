"""Gemma 2 and Gemma 3 (text) in the decode plan (docs/decode-step.md), each feature probed,
not named: RMSNorms applying ``1 + w`` in float32 (four per layer, and Gemma 3's QK-norm),
the embedding scaled by ``sqrt(hidden)`` in the model dtype, tanh-GELU gated MLPs,
attention and final logit softcapping, ``query_pre_attn_scalar``, sliding-window layers
beside global ones and Gemma 3's two rotary tables (local ``rope_local_base_freq``; global
``rope_theta``, here also with linear scaling). Per family: decode and verify steps through
the plan equal the compiled graph's bitwise (logits and every KV write) in fp32 and bf16,
with contexts longer than the window; the engine's greedy text through the plan (asserted
from its stats) equals transformers' generate, alone and in a batch."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts
from test_decode_plan import (
    _compare_decode_and_verify,
    _engine_greedy_on_plan_equals_transformers,
    _model_runner,
)

from torch_topg import _native
from torch_topg.compile.decode_plan import Unsupported, _activation, _rms, lower
from torch_topg.engine.model_runner import ModelRunner

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not _native.load(),
    reason="native library not loaded (not built, or TOPG_DISABLE_NATIVE=1): the decode plan "
    "(csrc/cpu/decode_plan.cpp) has no reference fallback",
)

#: hidden 80: sqrt(80) is not a bf16 value, so the embedding scale's rounding is exercised;
#: window 8 with prompts up to 38 tokens: the sliding layers drop keys.
_GEMMA = dict(hidden_size=80, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
              sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)  # fmt: skip
_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]


def _family(name: str) -> torch.nn.Module:
    import transformers

    if name == "gemma2":  # both softcaps, windows on layers 0 and 2
        cfg = transformers.Gemma2Config(**_GEMMA, layer_types=_TYPES, attn_logit_softcapping=20.0,
                                        final_logit_softcapping=5.0)  # fmt: skip
    elif name in ("gemma3", "gemma3-linear"):  # QK-norm, local / global rotary tables
        scaling = (
            {"rope_scaling": {"rope_type": "linear", "factor": 4.0}} if "linear" in name else {}
        )
        cfg = transformers.Gemma3TextConfig(**_GEMMA, layer_types=_TYPES, rope_theta=10000.0,
                                            rope_local_base_freq=100.0, **scaling)  # fmt: skip
    else:
        raise ValueError(name)
    cfg._attn_implementation = "eager"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        for n, p in model.named_parameters():  # norm weights around 0: 1 + w around 1
            p.data.normal_(0.0, 0.2 if "norm" in n else 0.02 if p.dim() > 1 else 0.01)
    return model.eval()


FAMILIES = ["gemma2", "gemma3"]


@pytest.mark.parametrize(
    ("family", "dtype"),
    [("gemma2", torch.float32), ("gemma2", torch.bfloat16), ("gemma3", torch.float32),
     ("gemma3", torch.bfloat16), ("gemma3-linear", torch.float32)],
    ids=["gemma2-fp32", "gemma2-bf16", "gemma3-fp32", "gemma3-bf16", "gemma3-linear-fp32"],
)  # fmt: skip
def test_gemma_plan_equals_compiled_graph(family, dtype):
    """(The linearly scaled global table is one more table: fp32 covers it.)"""
    r = _model_runner(_family(family).to(dtype))
    assert r.plan is not None, r.plan_reason
    _compare_decode_and_verify(r, 43, steps=6, verify=[[5, 6, 7, 8], [9, 10]])


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_through_the_plan_equals_transformers(family):
    """fp32, alone and in a batch, prompts longer than the window: the decode steps ran on
    the plan (its stats say so) and the greedy tokens are transformers' generate."""
    model = _family(family)
    ps = prompts(47, [13, 5, 21])
    _engine_greedy_on_plan_equals_transformers(model, ps)


def test_norm_form_and_activation_are_measured():
    """Gemma's norm is found to apply 1 + w, Llama's w (whatever their names); a norm of
    neither form and an activation the plan lacks are refused, naming the module."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gemma = _family("gemma3")
    assert _rms(gemma.model.norm, "model.norm")[2] == 1
    assert _rms(gemma.model.layers[0].self_attn.q_norm, "q_norm")[2] == 1
    llama = LlamaRMSNorm(16)
    llama.weight.data.uniform_(0.5, 1.5)
    assert _rms(llama, "norm")[2] == 0

    class DoubledRMSNorm(LlamaRMSNorm):
        def forward(self, x):
            return super().forward(x) * 2

    doubled = DoubledRMSNorm(16)
    doubled.weight.data.uniform_(0.5, 1.5)  # 2 w is neither w nor 1 + w
    with pytest.raises(Unsupported, match=r"norm \(DoubledRMSNorm\) is neither x \* w"):
        _rms(doubled, "norm")
    assert _activation(gemma.model.layers[0].mlp, "mlp") == 2  # tanh GELU
    mlp = gemma.model.layers[0].mlp
    mlp.act_fn = torch.nn.ReLU()
    with pytest.raises(Unsupported, match=r"layers.0.mlp.act_fn \(ReLU\) is not SiLU"):
        r = ModelRunner(gemma, num_blocks=8, block_size=4, max_blocks_per_seq=4, compile=False)
        lower(r.model, r.kv_caches, block_size=4, max_positions=16)


def test_final_softcap_bounds_the_plans_logits():
    """Gemma 2's final softcap runs after the native call: the plan's logits lie within
    (-cap, cap) and equal tanh(raw / cap) * cap of the uncapped plan's logits."""
    model = _family("gemma2")
    r = _model_runner(model)
    capped = r.plan
    assert capped._cap == 5.0
    from engine_utils import Seqs

    seqs = Seqs(r, prompts(3, [12]), seed=1)
    seqs.prefill()
    b = seqs.decode_batch([seqs.toks[0][-1]])
    args = (b.input_ids, b.positions, b.slot_mapping, b.block_tables, b.seq_lens,
            b.cu_seqlens_q, b.logits_indices)  # fmt: skip
    kv = [c.clone() for c in r.kv_caches]
    raw = capped._plan.run(*args)
    for c, c0 in zip(r.kv_caches, kv, strict=True):
        c.copy_(c0)
    got = capped.run(*args)
    assert got.abs().max() < 5.0 and raw.abs().max() > got.abs().max()
    assert torch.equal(got, torch.tanh(raw / 5.0) * 5.0)
