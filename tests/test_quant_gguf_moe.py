"""A Qwen2-MoE GGUF file run packed (``quantization="gguf"``): its stacked expert tensors
become ``QuantizedExperts`` (``fused_moe_q``), the shared expert ``QuantizedLinear`` s,
the router float. The file is written here with gguf-py from a seeded tiny model, in
llama.cpp's tensor names and layout (the SmolLM2 file's tokenizer, Q8_0 / Q4_0 blocks
packed by ``torch_topg.quant.quantize_weight``, which are GGUF's own)."""

from __future__ import annotations

import warnings

import gguf
import numpy as np
import pytest
import torch
from engine_utils import hf_greedy
from gguf_files import GGUF_FP32_ACT, close_file, open_file

from torch_topg.engine import Engine
from torch_topg.engine.loading import load_gguf_packed
from torch_topg.models import build_model
from torch_topg.quant import QuantizedExperts, QuantizedLinear, dequantize, quantize_weight
from torch_topg.quant.gguf_direct import _unpermute

GREEDY = dict(temperature=0, ignore_eos=True)


def _write(model: torch.nn.Module, path, fmt: str) -> dict[str, torch.Tensor]:
    """``model`` (a Qwen2-MoE) as a GGUF file, its matrices packed in ``fmt``; returns the
    float weights the file stands for (de-quantised), by transformers name."""
    c = model.config
    mixtral = c.model_type == "mixtral"  # llama.cpp writes it as architecture "llama"
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[fmt]
    w = open_file(path, "llama" if mixtral else "qwen2moe", c)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_expert_count(c.num_local_experts if mixtral else c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if not mixtral:
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    dense: dict[str, torch.Tensor] = {}

    heads = {"attn_q": c.num_attention_heads, "attn_k": c.num_key_value_heads}

    def packed(name: str, value: torch.Tensor, key: str) -> None:
        rows = value.detach().float().reshape(-1, value.shape[-1])
        q = quantize_weight(rows, fmt)
        dense[key] = dequantize(q, fmt, rows.shape[1]).reshape(value.shape)
        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if mixtral and kind in heads:  # llama.cpp's converter permutes q / k rows per head
            q = q.index_select(0, torch.argsort(_unpermute(q.shape[0], heads[kind])))
        w.add_tensor(name, q.reshape(*value.shape[:-1], -1).numpy(), raw_dtype=qtype)

    def plain(name: str, value: torch.Tensor, key: str) -> None:
        dense[key] = value.detach().float()
        w.add_tensor(name, value.detach().float().numpy())

    sd = dict(model.state_dict())
    packed("token_embd.weight", sd["model.embed_tokens.weight"], "model.embed_tokens.weight")
    plain("output_norm.weight", sd["model.norm.weight"], "model.norm.weight")
    packed("output.weight", sd["lm_head.weight"], "lm_head.weight")
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}  # fmt: skip
    if not mixtral:
        names.update({"ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                      "ffn_up_shexp": "mlp.shared_expert.up_proj",
                      "ffn_down_shexp": "mlp.shared_expert.down_proj"})  # fmt: skip
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        plain(
            f"blk.{i}.attn_norm.weight",
            sd[p + "input_layernorm.weight"],
            p + "input_layernorm.weight",
        )
        plain(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"], p + "post_attention_layernorm.weight")  # fmt: skip
        for short, long in names.items():
            packed(f"blk.{i}.{short}.weight", sd[p + long + ".weight"], p + long + ".weight")
            if p + long + ".bias" in sd:
                plain(f"blk.{i}.{short}.bias", sd[p + long + ".bias"], p + long + ".bias")
        plain(f"blk.{i}.ffn_gate_inp.weight", sd[p + "mlp.gate.weight"], p + "mlp.gate.weight")
        if not mixtral:
            gate = sd[p + "mlp.shared_expert_gate.weight"]
            plain(f"blk.{i}.ffn_gate_inp_shexp.weight", gate.reshape(-1), p + "mlp.shared_expert_gate.weight")  # fmt: skip
            dense[p + "mlp.shared_expert_gate.weight"] = gate.detach().float()
        gu, down = sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"]
        inter = down.shape[2]
        packed(f"blk.{i}.ffn_gate_exps.weight", gu[:, :inter], p + "gate")
        packed(f"blk.{i}.ffn_up_exps.weight", gu[:, inter:], p + "up")
        packed(f"blk.{i}.ffn_down_exps.weight", down, p + "mlp.experts.down_proj")
        dense[p + "mlp.experts.gate_up_proj"] = torch.cat(
            [dense.pop(p + "gate"), dense.pop(p + "up")], 1
        )
    close_file(w)
    return dense


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_qwen2moe_gguf_runs_packed(tmp_path, fmt):
    # sizes transformers' GGUF reader does not map (its Qwen2-MoE defaults differ)
    model = build_model("qwen2moe-tiny", moe_intermediate_size=64,
                        shared_expert_intermediate_size=96)  # fmt: skip
    path = tmp_path / f"moe-{fmt}.gguf"
    dense = _write(model, path, fmt)
    reference = build_model("qwen2moe-tiny", moe_intermediate_size=64,
                            shared_expert_intermediate_size=96)  # fmt: skip
    reference.load_state_dict(dense, strict=False)  # the file's weights, de-quantised
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed, tok = load_gguf_packed(path, torch.float32, GGUF_FP32_ACT)
    assert tok is not None
    layer = packed.model.layers[1].mlp
    assert isinstance(layer.experts, QuantizedExperts) and layer.experts.format == fmt
    assert layer.experts.intermediate_dim == 64  # from the file, not the class default
    assert isinstance(layer.shared_expert.down_proj, QuantizedLinear)
    assert layer.gate.weight.dtype == torch.float32
    ids = torch.tensor([[1, 5, 9, 200, 255, 17, 42]])
    with torch.no_grad():
        got, want = packed(ids).logits, reference(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the packed bytes are the file's, not a re-quantisation
    down = next(
        t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down_exps.weight"
    )
    np.testing.assert_array_equal(
        layer.experts.qdown.numpy(), np.asarray(down.data).reshape(4, 64, -1)
    )
    if fmt == "q4_0":  # the engine on the file (one format: each load parses the tokenizer)
        prompt = ids[0].tolist()
        with Engine.from_pretrained(path, quantization=GGUF_FP32_ACT, max_model_len=128) as eng:
            out = eng.generate([prompt], max_new_tokens=6, **GREEDY)[0].token_ids
        assert out == hf_greedy(reference, prompt, 6)


@pytest.fixture(scope="module")
def mixtral_file(tmp_path_factory):
    """A tiny Mixtral written as a Q8_0 Mixtral-type file (once for the module), and the
    model holding the file's de-quantised weights."""
    path = tmp_path_factory.mktemp("mixtral") / "mixtral-q8_0.gguf"
    dense = _write(build_model("mixtral-tiny"), path, "q8_0")
    reference = build_model("mixtral-tiny")
    reference.load_state_dict(dense, strict=False)
    return path, reference


def test_mixtral_gguf_runs_packed(mixtral_file):
    """A Mixtral-type file (architecture "llama" with experts, q / k rows permuted as
    llama.cpp's converter does): transformers reads it as a dense Llama; topg builds
    Mixtral and runs its experts packed."""
    path, reference = mixtral_file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed, _ = load_gguf_packed(path, torch.float32, GGUF_FP32_ACT)
    assert packed.config.model_type == "mixtral" and packed.config.num_local_experts == 4
    assert isinstance(packed.model.layers[0].mlp.experts, QuantizedExperts)
    ids = torch.tensor([[1, 5, 9, 200, 255, 17, 42]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_mixtral_gguf_mapped_copies_release_the_file_pages(mixtral_file, monkeypatch):
    """Every tensor counted big (views of the mapped file): the concatenated gate / up
    rows are built in huge-page memory (no second copy by rehome_) and the mapped pages
    they, and the un-permuted q rows, were copied from are released; the same logits."""
    from torch_topg.utils import hugepages

    if not hugepages.enabled():
        pytest.skip(
            "the kernel refuses MADV_HUGEPAGE (no transparent huge pages): nothing is mapped"
        )
    path, reference = mixtral_file
    monkeypatch.setattr(hugepages, "HUGE_PAGE", 4096)
    released: list[tuple[int, ...]] = []
    real = hugepages.release_file_pages
    monkeypatch.setattr(hugepages, "release_file_pages",
                        lambda *ts: (released.extend(tuple(t.shape) for t in ts), real(*ts)))  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed, _ = load_gguf_packed(path, torch.float32, GGUF_FP32_ACT)
    layers = packed.model.layers
    for layer in layers:
        experts = layer.mlp.experts
        assert hugepages.in_huge_pages(experts.qgate_up)
        assert experts.qgate_up.shape[:2] == (4, 2 * experts.intermediate_dim)
    stacks = [s for s in released if len(s) == 3]  # gate and up of each layer
    assert len(stacks) == 2 * len(layers)
    # the un-permuted q rows of each layer (k's are under the 4 KiB taken for big here)
    assert len([s for s in released if len(s) == 2]) >= len(layers)
    ids = torch.tensor([[1, 5, 9, 200, 255, 17, 42]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, reference(ids).logits, atol=1e-4, rtol=1e-4)


def test_mixtral_gguf_default_loads_dequantised(mixtral_file):
    """``quantization=None`` (the default) on a Mixtral-type file: transformers alone
    builds a dense Llama with random MLPs from it; topg builds Mixtral with the file's
    de-quantised weights (the logits of the model they came from), and so does the
    engine (its greedy tokens)."""
    from transformers import AutoConfig

    from torch_topg.quant.gguf_direct import load_dequantized

    path, reference = mixtral_file
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        assert config.model_type == "llama"  # transformers' reading
        loaded = load_dequantized(path, config, torch.float32)
    assert type(loaded).__name__ == "MixtralForCausalLM"
    assert not any(isinstance(m, QuantizedExperts) for m in loaded.modules())
    ids = torch.tensor([[1, 5, 9, 200, 255, 17, 42]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, atol=1e-5, rtol=1e-5)
    prompt = ids[0].tolist()
    with Engine.from_pretrained(path, max_model_len=128) as eng:  # the file's tokenizer: ~20 s
        out = eng.generate([prompt], max_new_tokens=6, **GREEDY)[0].token_ids
    assert out == hf_greedy(reference, prompt, 6)
