"""Families the engine runs with no code of its own for them: tiny random configs of
decoder families that no module of torch_topg names, greedy output equal to
transformers' alone, in a batch and with prefix reuse; and refusals that name the missing
feature before any weight loads (engine/families.py)."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest
import torch
import transformers
from engine_utils import hf_greedy, whole_pool

from torch_topg.engine import Engine
from torch_topg.engine.families import UnsupportedModel, check_config, check_supported

ROOT = pathlib.Path(__file__).resolve().parents[1]
BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
WINDOWED = dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])

#: model_type -> (config class, what the family adds to the Llama decoder)
FAMILIES = {
    "olmo2": ("Olmo2Config", {}),  # post-norms, QK-norm over all heads
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),  # embedding, residual, attention and logit multipliers
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5)),  # fused qkv, partial rotary
    "smollm3": ("SmolLM3Config", dict(no_rope_layer_interval=2)),  # layers without rotary
    "gemma3_text": ("Gemma3TextConfig", dict(WINDOWED, query_pre_attn_scalar=16)),  # mixed windows
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2)),  # MoE, QK-norm
    "starcoder2": ("Starcoder2Config", {}),  # biases, LayerNorm, GELU MLP
    "glm4": ("Glm4Config", dict(head_dim=16)),  # fused gate/up, extra norms
    # attention sinks, alternating sliding / full layers, MoE with biased clamped-SwiGLU
    # experts (not fused_moe's: they run their own code), YaRN rotary
    "gpt_oss": ("GptOssConfig", dict(WINDOWED, num_local_experts=4, num_experts_per_tok=2)),
}


def family_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":  # learned positions, Conv1D projections, its own config names
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                         n_positions=256, bos_token_id=1, eos_token_id=2)  # fmt: skip
        config._attn_implementation = "sdpa"
        return transformers.GPT2LMHeadModel(config).eval()
    cls, extra = FAMILIES[kind]
    config = getattr(transformers, cls)(**{**BASE, **extra})
    config._attn_implementation = "eager" if "layer_types" in extra else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # sinks large enough to decide tokens (initialised near 0)
        for sinks in _sink_params(model):
            sinks.normal_(0.0, 3.0)
    return model


def _sink_params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)]


def test_no_module_names_these_families():
    """The generic path: nothing in torch_topg/ mentions these model types, except the
    benchmarks' model shapes (torch_topg/bench) and the GGUF readers, where an
    architecture name is the file format's key for its tensor and metadata names."""
    paths = ["torch_topg", ":!torch_topg/bench", ":!torch_topg/quant/gguf_*",
             ":!torch_topg/engine/gguf_*"]  # fmt: skip
    for kind in [*FAMILIES, "gpt2"]:
        r = subprocess.run(["git", "grep", "-l", "-w", kind, "--", *paths], cwd=ROOT,
                           capture_output=True, text=True)  # fmt: skip
        assert r.returncode in (0, 1) and not r.stdout.strip(), (kind, r.stdout)


@pytest.mark.parametrize("kind", [*FAMILIES, "gpt2"])
def test_family_greedy_equals_transformers(kind):
    model = family_model(kind)
    p, q = list(range(3, 23)), list(range(40, 49))
    want = [hf_greedy(model, x, 10) for x in (p, q)]
    greedy = dict(max_new_tokens=10, temperature=0, ignore_eos=True)
    with Engine.from_model(model, block_size=4) as eng, whole_pool(eng):
        assert eng.generate([p], **greedy)[0].token_ids == want[0]  # alone
        out = eng.generate([p, q], **greedy)  # in a batch
        assert [o.token_ids for o in out] == want
        assert out[0].cached_prompt_tokens > 0  # p's blocks came from the prefix cache
        assert eng.stats()["compile"]["while_serving"] == 0


def _config_folder(tmp_path: pathlib.Path, config) -> pathlib.Path:
    """A checkpoint folder with a config and no weights: a refusal must come first."""
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return tmp_path


def test_refused_before_loading(tmp_path):
    config = transformers.CONFIG_MAPPING["falcon"]()
    with pytest.raises(UnsupportedModel, match="attention outside") as e:
        Engine.from_pretrained(str(_config_folder(tmp_path, config)))
    assert e.value.param == "model"


def test_attention_sinks_decide_the_tokens():
    """The sinks of the GPT-OSS config above change its greedy tokens, so the family test
    fails if the engine drops them; and the engine's probe accepts the family."""
    model = family_model("gpt_oss")
    check_supported(model.config)
    p = list(range(3, 23))
    want = hf_greedy(model, p, 10)
    with torch.no_grad():
        for sinks in _sink_params(model):
            sinks.fill_(float("-inf"))  # a sink of -inf weighs nothing
    assert hf_greedy(model, p, 10) != want


@pytest.mark.parametrize(
    ("kind", "overrides", "feature"),
    [
        ("t5", {}, "encoder-decoder"),
        ("qwen3_next", {}, "layers other than attention layers"),
        ("llama4_text", {}, "layers other than attention layers"),
        ("gemma3n_text", {}, "KV shared across layers"),
        ("falcon", {}, "attention outside transformers' attention interface"),
    ],
)
def test_unsupported_features_are_named(kind, overrides, feature):
    config = transformers.CONFIG_MAPPING[kind](**overrides)
    with pytest.raises(UnsupportedModel, match=feature):
        check_config(config)


def test_sink_kwarg_reaches_the_kernel():
    """transformers' ``s_aux`` (in the model's dtype) becomes paged_attention's ``sinks``."""
    from torch_topg import reference
    from torch_topg.engine.attention import paged_attention_forward

    torch.manual_seed(0)
    hq, hkv, d, t = 4, 2, 16, 3
    q, k, v = torch.randn(1, hq, t, d), torch.randn(1, hkv, t, d), torch.randn(1, hkv, t, d)
    kc, vc = torch.zeros(2, 4, hkv, d), torch.zeros(2, 4, hkv, d)
    mod = torch.nn.Module()
    mod.layer_idx = 0
    meta = dict(topg_kv_caches=[kc, vc], topg_slot_mapping=torch.arange(t),
                topg_block_tables=torch.tensor([[0, 1]], dtype=torch.int32),
                topg_seq_lens=torch.tensor([t], dtype=torch.int32),
                topg_cu_seqlens_q=torch.tensor([0, t], dtype=torch.int32))  # fmt: skip
    s_aux = torch.randn(hq, dtype=torch.bfloat16) * 3
    out, _ = paged_attention_forward(mod, q, k, v, None, scaling=0.25, s_aux=s_aux, **meta)
    want = reference.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               causal=True, scale=0.25, sinks=s_aux.float())  # fmt: skip
    torch.testing.assert_close(out, want)
