"""``torch_topg.quantize`` on tiny transformers models: which modules are replaced, logits
equal to the same model with the de-quantised weights in ``nn.Linear``, saving and
loading through safetensors, and the engine (eager and compiled) giving transformers'
greedy tokens on the quantised model."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from engine_utils import hf_greedy, prompts, tiny

import torch_topg
from torch_topg.engine import Engine
from torch_topg.quant import QuantizedLinear, load_quantized, save_quantized

pytest.importorskip("transformers")

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():  # the reference fallback's warning (no CPU kernel yet)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every QuantizedLinear turned back into nn.Linear (float32 weight
    = the exactly de-quantised packed weight)."""
    ref = copy.deepcopy(model)
    for name, m in list(ref.named_modules()):
        if isinstance(m, QuantizedLinear):
            lin = torch.nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
            lin.weight.data.copy_(m.dequantized_weight())
            if m.bias is not None:
                lin.bias.data.copy_(m.bias)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, lin)
    return ref


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize(
    ("method", "group_size", "fmt"),
    [("int8", 64, "int8"), ("int4", 32, "int4_g32"), ("int4", 128, "int4_g128"), ("q8_0", 64, "q8_0")],
)  # fmt: skip
def test_quantize_replaces_linears_not_the_head(method, group_size, fmt):
    model = tiny("llama-tiny")
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    original = copy.deepcopy(model)
    assert torch_topg.quantize(model, method, group_size=group_size) is model
    quantized = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(quantized) == linears - {"lm_head"}
    assert {m.format for m in quantized.values()} == {fmt}
    assert isinstance(model.lm_head, torch.nn.Linear)
    ids = torch.tensor([prompts(0, [11])[0]])
    got = _logits(model, ids)
    torch.testing.assert_close(got, _logits(_dequantized_copy(model), ids), atol=2e-5, rtol=2e-5)
    # and near the float model: the error of the format, not a scrambled layout
    err = (got - _logits(original, ids)).abs().max().item()
    assert err < {"int8": 0.01, "q8_0": 0.01}.get(fmt, 0.1), err


def test_quantize_head_skip_and_errors():
    model = tiny("qwen2-tiny")  # q/k/v carry biases
    torch_topg.quantize(model, "int8", lm_head=True, skip=["model.layers.1.mlp.down_proj"])
    assert isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.model.layers[1].mlp.down_proj, torch.nn.Linear)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, QuantizedLinear) and q.bias is not None
    ids = torch.tensor([prompts(1, [7])[0]])
    torch.testing.assert_close(
        _logits(model, ids), _logits(_dequantized_copy(model), ids), atol=2e-5, rtol=2e-5
    )
    with pytest.raises(ValueError, match="group_size 48 is not one of 32, 64, 128"):
        torch_topg.quantize(tiny("llama-tiny"), "int4", group_size=48)
    with pytest.raises(ValueError, match="unknown method 'int3'"):
        torch_topg.quantize(tiny("llama-tiny"), "int3")


def test_bfloat16_model():
    model = torch_topg.quantize(tiny("llama-tiny"), "int4", group_size=64).to(torch.bfloat16)
    ref = _dequantized_copy(model.float()).to(torch.bfloat16)
    model = model.to(torch.bfloat16)
    ids = torch.tensor([prompts(2, [9])[0]])
    got = _logits(model, ids)
    assert got.dtype == torch.bfloat16 and model.model.layers[0].mlp.up_proj.qweight.dtype == (
        torch.uint8
    )
    torch.testing.assert_close(got, _logits(ref, ids), atol=0.05, rtol=0.05)


def test_save_and_load_round_trip(tmp_path):
    model = torch_topg.quantize(tiny("qwen2-tiny"), "int4", group_size=64)
    torch_topg.quantize(model, "int8", lm_head=True)  # only the head is still nn.Linear
    path = tmp_path / "model.safetensors"
    save_quantized(model, path)
    fresh = tiny("qwen2-tiny", seed=7)  # other weights, same config
    assert load_quantized(fresh, path) is fresh
    assert isinstance(fresh.lm_head, QuantizedLinear) and fresh.lm_head.format == "int8"
    assert fresh.model.layers[0].mlp.gate_proj.format == "int4_g64"
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    ids = torch.tensor([prompts(3, [12])[0]])
    assert torch.equal(_logits(model, ids), _logits(fresh, ids))


def test_load_refuses_a_module_that_is_not_linear(tmp_path):
    model = torch_topg.quantize(tiny("llama-tiny"), "int8")
    path = tmp_path / "m.safetensors"
    save_quantized(model, path)
    other = tiny("llama-tiny")
    other.model.layers[0].mlp.up_proj = torch.nn.Identity()
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj' is quantised"):
        load_quantized(other, path)


@pytest.mark.parametrize("compile", [False, True])
def test_engine_greedy_equals_transformers_on_the_quantised_model(compile):
    model = torch_topg.quantize(tiny("llama-tiny"), "int4", group_size=32)
    ps = prompts(4, [9, 23, 5])
    want = [hf_greedy(model, p, 8) for p in ps]
    with Engine.from_model(model, block_size=4, compile=compile) as eng:
        got = [o.token_ids for o in eng.generate(ps, max_new_tokens=8, **GREEDY)]
    assert got == want


def test_int8_activations_option_skips_the_head():
    model = torch_topg.quantize(tiny("llama-tiny"), "int4", lm_head=True, int8_activations=True)
    assert model.model.layers[0].mlp.up_proj.int8_activations
    assert isinstance(model.lm_head, QuantizedLinear) and not model.lm_head.int8_activations
    exact = torch_topg.quantize(tiny("llama-tiny"), "int4", lm_head=True)
    ids = torch.tensor([prompts(6, [10])[0]])
    a, b = _logits(model, ids), _logits(exact, ids)
    assert not torch.equal(a, b)  # the activations were rounded
    torch.testing.assert_close(a, b, atol=0.05, rtol=0.05)
