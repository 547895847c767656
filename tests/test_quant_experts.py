"""``torch_topg.quantize`` on MoE models: experts become ``QuantizedExperts``
(``fused_moe_q``), equal to the model with the de-quantised experts, saved and loaded,
and run by the engine (eager and ``backend="topg"``) as transformers runs them."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_utils import hf_greedy, prompts, tiny

import torch_topg
from torch_topg.engine import Engine
from torch_topg.quant import QuantizedExperts, QuantizedLinear, load_quantized, save_quantized

GREEDY = dict(temperature=0, ignore_eos=True)


def _dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` whose quantised experts are float experts again (a deep copy of the
    module the quantiser replaced, its weights the exactly de-quantised packed ones)."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, QuantizedExperts):
            gu, down = m.dequantized()
            e = ref._float_experts[name]
            e.gate_up_proj.data.copy_(gu)
            e.down_proj.data.copy_(down)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, e)
    return ref


def _quantized(preset: str, method: str, **kw) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = tiny(preset)
    original = copy.deepcopy(model)
    experts = {n: copy.deepcopy(m) for n, m in model.named_modules() if hasattr(m, "gate_up_proj")}
    torch_topg.quantize(model, method, group_size=32, **kw)
    model._float_experts = experts  # for _dequantized_copy
    return model, original


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("preset", ["mixtral-tiny", "qwen2moe-tiny"])
@pytest.mark.parametrize("method", ["int8", "int4", "q8_0"])
def test_quantize_replaces_experts(preset, method):
    model, original = _quantized(preset, method)
    qe = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedExperts)}
    n_layers = model.config.num_hidden_layers
    # qwen2moe-tiny's experts have I = 48: q8_0 blocks of 32 cannot pack it, so they stay
    packable = not (preset == "qwen2moe-tiny" and method == "q8_0")
    assert len(qe) == (n_layers if packable else 0)
    ids = torch.tensor([prompts(0, [11])[0]])
    got = _logits(model, ids)
    torch.testing.assert_close(got, _logits(_dequantized_copy(model), ids), atol=2e-5, rtol=2e-5)
    err = (got - _logits(original, ids)).abs().max().item()
    assert err < (0.1 if method == "int4" else 0.01), err


def test_experts_option_and_activation():
    model = torch_topg.quantize(tiny("mixtral-tiny"), "int8", experts=False)
    assert not any(isinstance(m, QuantizedExperts) for m in model.modules())
    assert any(isinstance(m, QuantizedLinear) for m in model.modules())
    model = torch_topg.quantize(tiny("mixtral-tiny"), "int4", int8_activations=True)
    e = model.model.layers[0].mlp.experts
    assert isinstance(e, QuantizedExperts) and e.activation == "silu" and e.int8_activations
    assert "format=int4_g64" in repr(e)
    with pytest.raises(ValueError, match="intermediate size 48 must be"):
        QuantizedExperts.like(tiny("qwen2moe-tiny").model.layers[0].mlp.experts, "q8_0")


def test_save_and_load_round_trip(tmp_path):
    model, _ = _quantized("mixtral-tiny", "q4_1")
    path = tmp_path / "moe.safetensors"
    save_quantized(model, path)
    loaded = load_quantized(tiny("mixtral-tiny", seed=5), path)
    assert isinstance(loaded.model.layers[1].mlp.experts, QuantizedExperts)
    ids = torch.tensor([prompts(1, [13])[0]])
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


@pytest.mark.parametrize("compile", [False, True])
def test_engine_greedy_equals_transformers_on_quantised_experts(compile):
    model = torch_topg.quantize(tiny("mixtral-tiny"), "int4", group_size=32)
    ps = prompts(4, [9, 23, 5])
    want = [hf_greedy(model, p, 8) for p in ps]
    with Engine.from_model(model, block_size=4, compile=compile) as eng:
        got = [o.token_ids for o in eng.generate(ps, max_new_tokens=8, **GREEDY)]
    assert got == want
