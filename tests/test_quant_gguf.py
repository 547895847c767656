"""GGUF weights run as they are (``quantization="gguf"``) and the engine's quantization
option: the shipped SmolLM2 Q4_1 file's tensors swapped in packed (q8_0 embedding tied
to the LM head, q4_1 linears) give the float model's logits bit for bit through the
reference, and the engine's greedy text equals the float engine's; option errors."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from engine_utils import hf_greedy, prompts, tiny
from gguf_files import GGUF_FP32_ACT

import torch_topg
from torch_topg.engine import Engine
from torch_topg.models import load_smollm2, smollm2_available
from torch_topg.models.hf import gguf_path
from torch_topg.quant import QuantizedLinear
from torch_topg.quant.modules import QuantizedEmbedding

pytest.importorskip("gguf")
SMOLLM2 = pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available()))
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(autouse=True)
def _quiet_fallback():
    with warnings.catch_warnings():  # the reference fallback's warning (no CPU kernel yet)
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


@SMOLLM2
def test_smollm2_gguf_weights_packed_same_logits():
    from torch_topg.quant.gguf_model import use_gguf_weights

    model, tok = load_smollm2(torch.float32)
    # More than 16 tokens: linear_q then takes its GEMM path (rows de-quantised, at::mm),
    # which sums as the float model's F.linear does, so the logits compare bit for bit;
    # the GEMV (M <= 16) sums in another order and is checked against the reference.
    text = "The capital of France is Paris, and the capital of Italy is Rome; the capital of"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids.shape[1] > 16
    with torch.inference_mode():
        want = model(ids).logits
    replaced = use_gguf_weights(model, gguf_path())
    layers = model.config.num_hidden_layers
    assert len(replaced) == 7 * layers + 2, len(replaced)
    assert replaced["model.embed_tokens"] == "token_embd.weight (q8_0)"
    assert replaced["model.layers.0.self_attn.q_proj"] == "blk.0.attn_q.weight (q4_1)"
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.format == "q8_0"
    assert model.lm_head.qweight is model.model.embed_tokens.qweight  # tied: one buffer
    assert not any(p.dim() == 2 for p in model.parameters()), "a float matrix remains"
    with torch.inference_mode():
        got = model(ids).logits
    assert torch.equal(got, want)

    # Built straight from the file (no float copy; q / k rows un-permuted by index):
    # the same packed buffers and floats as the row matching found, the same logits.
    from torch_topg.quant.gguf_direct import load_packed

    direct = load_packed(gguf_path(), model.config, torch.float32)
    assert direct is not None
    a = dict(direct.named_parameters()) | dict(direct.named_buffers())
    b = dict(model.named_parameters()) | dict(model.named_buffers())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert direct.lm_head.qweight is direct.model.embed_tokens.qweight
    with torch.inference_mode():
        assert torch.equal(direct(ids).logits, want)


@SMOLLM2
@pytest.mark.skipif(
    not torch_topg.native_available(), reason="SmolLM2 decode through the fallback is slow"
)
def test_engine_gguf_greedy_equals_float_engine():
    """The packed q4_1 model (exact fp32 path: int8_activations off) gives the float
    engine's greedy tokens: the same weights, the same math up to summation order.
    Both engines run uncompiled (prefill eager, decode on the plan): compiling SmolLM2's
    30 layers twice was 2/3 of this test's time, and the compiled packed path is tested on the
    tiny models (test_engine_from_model_int8, test_quant_gguf_moe.py)."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    with Engine.from_pretrained(seed=0, compile=False) as eng:
        want = eng.generate(question, max_new_tokens=12, **GREEDY)[0]
    with Engine.from_pretrained(quantization=GGUF_FP32_ACT, seed=0, compile=False) as eng:
        assert isinstance(eng.model.model.layers[3].mlp.down_proj, QuantizedLinear)
        got = eng.generate(question, max_new_tokens=12, **GREEDY)[0]
    assert "Paris" in got.text, got.text
    assert got.token_ids == want.token_ids


def test_engine_from_model_int8():
    model = tiny("llama-tiny")
    ref = torch_topg.quantize(copy.deepcopy(model), "int8")
    ps = prompts(5, [7, 15])
    want = [hf_greedy(ref, p, 6) for p in ps]
    with Engine.from_model(model, quantization="int8", block_size=4) as eng:
        assert isinstance(eng.model.model.layers[0].self_attn.o_proj, QuantizedLinear)
        got = [o.token_ids for o in eng.generate(ps, max_new_tokens=6, **GREEDY)]
    assert got == want


def test_engine_quantization_dict_int8_activations_on_the_plan():
    """``{"method": "int4", "group_size": 32, "int8_activations": True}``: every linear
    but the head quantised with int8 activations, decoded on the plan."""
    model = tiny("llama-tiny")
    q = {"method": "int4", "group_size": 32, "int8_activations": True}
    with Engine.from_model(model, quantization=q, block_size=4) as eng:
        o_proj = eng.model.model.layers[0].self_attn.o_proj
        assert isinstance(o_proj, QuantizedLinear) and o_proj.format == "int4_g32"
        assert o_proj.int8_activations
        assert not isinstance(eng.model.lm_head, QuantizedLinear)
        out = eng.generate([[5, 6, 7, 8]], max_new_tokens=6, **GREEDY)[0]
        assert len(out.token_ids) == 6
        if torch_topg.native_available():
            assert eng.stats()["decode_plan"]["active"], eng.stats()["decode_plan"]


def test_quantization_option_errors():
    with pytest.raises(ValueError, match="quantization 'fp8' is not one of None, 'gguf'"):
        Engine.from_pretrained("/nonexistent", quantization="fp8")
    with pytest.raises(ValueError, match=r"keys \['bits'\] are not among"):
        Engine.from_pretrained("/nonexistent", quantization={"method": "int8", "bits": 4})
    with pytest.raises(ValueError, match="group_size applies to method 'int4' only"):
        Engine.from_pretrained("/nonexistent", quantization={"method": "gguf", "group_size": 32})
    with pytest.raises(ValueError, match="int8_activations must be True or False"):
        Engine.from_pretrained("/nonexistent", quantization={"method": "gguf",
                                                             "int8_activations": 1})  # fmt: skip
    with pytest.raises(ValueError, match="quantization: 'gguf' is not supported with tp_size=2"):
        Engine.from_pretrained("/nonexistent", quantization="gguf", tp_size=2)
    with pytest.raises(ValueError, match="quantization: 'gguf' needs from_pretrained"):
        Engine.from_model(tiny("llama-tiny"), quantization="gguf")
    from torch_topg.quant.loading import gguf_file

    with pytest.raises(ValueError, match="needs a .gguf file or None"):
        gguf_file("some/folder")
