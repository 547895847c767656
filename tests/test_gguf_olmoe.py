"""OLMoE GGUF files as llama.cpp makes them: a tiny random OLMoE-1B-7B-shaped checkpoint
(``torch_topg.bench.real_size``) written as GGUF by llama.cpp's own converter, quantised
by its ``llama-quantize`` when that is built (else Q8_0 by the converter itself).

transformers' GGUF reader refuses architecture ``olmoe`` (config and tokenizer alike);
the engine builds both from the file's metadata (``torch_topg/quant/gguf_arch.py``,
``torch_topg/engine/gguf_tokenizer.py``) and the model from its tensors
(``torch_topg/quant/gguf_direct.py``): the BF16 file gives transformers' greedy tokens on
the safetensors folder it was made from; a Q8_0 file runs packed (``QuantizedExperts``,
``fused_moe_q``) and matches its de-quantised weights; so does a Q4_K_M file (Q4_K, Q6_K),
with two tensors in Q5_0, which has no packed kernel here, de-quantised."""

from __future__ import annotations

import logging
import subprocess
import sys
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from engine_utils import hf_greedy
from gguf_files import GGUF_FP32_ACT

from torch_topg.engine import Engine
from torch_topg.engine.gguf_meta import config_and_tokenizer
from torch_topg.engine.loading import load_gguf_packed
from torch_topg.models import smollm2_available
from torch_topg.quant import QuantizedExperts, QuantizedLinear
from torch_topg.quant.gguf_arch import read_file
from torch_topg.quant.gguf_direct import load_dequantized

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python" / "benchmarks"))
from llama_cpp_build import binaries, llama_cpp_sources

pytestmark = pytest.mark.skipif(smollm2_available() is not None, reason=str(smollm2_available()))

#: OLMoE-1B-7B's shape, shrunk (the real vocabulary: SmolLM2's tokenizer padded to it).
#: Rows of 256 hold whole K-quant blocks: narrower ones llama-quantize writes as Q5_0 /
#: Q8_0 in a Q4_K_M file, so there would be no Q4_K to run.
SHAPE = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, num_experts=4, num_experts_per_tok=2)  # fmt: skip
GREEDY = dict(temperature=0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 200, 255, 17, 42], [3000, 40000, 7, 8], list(range(11, 24))]


def _quantize(bf16: Path, kind: str, converter: Path, folder: Path, *overrides: str) -> Path | None:
    """``bf16`` quantised to ``kind`` by llama-quantize (``overrides``: its
    ``--tensor-type name=type`` arguments); without it, Q8_0 by the converter and None
    for other kinds."""
    from torch_topg.bench.real_size import convert_to_gguf

    out = bf16.with_name(f"olmoe-{kind}.gguf")
    tool = binaries()["llama-quantize"]
    if tool.exists():
        args = [a for o in overrides for a in ("--tensor-type", o)]
        cmd = [str(tool), *args, str(bf16), str(out), kind]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode == 0, (r.stdout + r.stderr)[-1500:]
        return out
    if kind == "Q8_0":
        return convert_to_gguf(folder, out, converter, outtype="q8_0")
    return None


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """(safetensors folder, BF16 file, Q8_0 file, converter), made once for the module;
    the GGUF metadata cache in a folder of its own."""
    from torch_topg.bench.real_size import convert_to_gguf, write_checkpoint
    from torch_topg.models.hf import smollm2_folder

    try:
        converter = llama_cpp_sources() / "convert_hf_to_gguf.py"
    except Exception as e:  # a test that cannot make its file fails, saying why
        pytest.fail(f"llama.cpp's sources (convert_hf_to_gguf.py) could not be obtained: {e}")
    root = tmp_path_factory.mktemp("olmoe")
    smollm2 = smollm2_folder()  # from the shared cache (converting it again here: ~65 s)
    mp = pytest.MonkeyPatch()
    mp.setenv("TOPG_CACHE_DIR", str(root / "cache"))
    folder = write_checkpoint("olmoe-1b-7b", root / "hf", smollm2, **SHAPE)
    bf16 = convert_to_gguf(folder, root / "olmoe-bf16.gguf", converter)
    q8 = _quantize(bf16, "Q8_0", converter, folder)
    yield folder, bf16, q8, converter
    mp.undo()


@pytest.fixture(scope="module")
def reference(files):
    """transformers' model on the safetensors folder, in float32."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(files[0], dtype=torch.float32).eval()


def test_config_and_tokenizer_from_metadata(files, reference):
    """The config from the file's metadata has the folder's sizes (norm_topk_prob False:
    the converter writes no key for it, and OLMoE does not renormalise); the tokenizer
    from its tokenizer.ggml.* entries tokenizes and decodes as the folder's does."""
    from transformers import AutoTokenizer

    folder, bf16, _, _ = files
    config, tok = config_and_tokenizer(bf16)
    want = reference.config
    assert type(config) is type(want)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "num_experts",
                  "num_experts_per_tok", "max_position_embeddings", "rms_norm_eps",
                  "norm_topk_prob", "tie_word_embeddings", "clip_qkv", "attention_bias",
                  "hidden_act"):  # fmt: skip
        assert getattr(config, field) == getattr(want, field), field
    assert config.rope_parameters["rope_theta"] == want.rope_parameters["rope_theta"]
    assert config.norm_topk_prob is False and config.tie_word_embeddings is False
    ref_tok = AutoTokenizer.from_pretrained(folder)
    assert len(tok) == len(ref_tok) == config.vocab_size
    texts = ["Hello world, it's 2024!", "  two spaces\n\n\ttab", "ünïcödé 日本語 🙂 12345678",
             "<|im_start|>user\nHi<|im_end|>\n", "<|extra_3|>x<|extra_1151|>", "don't STOP'LL  "]  # fmt: skip
    for text in texts:
        ids = tok(text).input_ids
        assert ids == ref_tok(text).input_ids, text
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == ref_tok.decode(ids, skip_special_tokens=True)  # fmt: skip
    chat = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(chat, tokenize=False) == ref_tok.apply_chat_template(chat, tokenize=False)  # fmt: skip
    again, tok2 = config_and_tokenizer(bf16)  # from the cache
    assert again.to_dict() == config.to_dict() and tok2(texts[0]).input_ids == tok(texts[0]).input_ids  # fmt: skip


def test_table_reads_what_the_file_states(files):
    """Keys the converter leaves out for OLMoE but a file may state override the table's
    defaults; a file missing a size, of an architecture without a table, or with another
    tokenizer model is refused naming it; ``add_bos_token`` adds BOS."""
    from torch_topg.engine.gguf_tokenizer import tokenizer_from_metadata
    from torch_topg.quant.gguf_arch import config_from_metadata, read_metadata

    meta, names = read_metadata(files[1])
    stated = {**meta, "olmoe.expert_weights_norm": True, "olmoe.attention.clamp_kqv": 8.0}
    config = config_from_metadata(stated, names)
    assert config.norm_topk_prob is True and config.clip_qkv == 8.0
    assert config_from_metadata(meta, [n for n in names if n != "output.weight"]).tie_word_embeddings  # fmt: skip
    with pytest.raises(ValueError, match="states no"):
        config_from_metadata({k: v for k, v in meta.items() if k != "olmoe.block_count"}, names)
    with pytest.raises(ValueError, match="'nosucharch' has no config table"):
        config_from_metadata({**meta, "general.architecture": "nosucharch"}, names)
    with pytest.raises(ValueError, match="tokenizer.ggml.model 'llama'"):
        tokenizer_from_metadata({**meta, "tokenizer.ggml.model": "llama"})
    tok = tokenizer_from_metadata({**meta, "tokenizer.ggml.add_bos_token": True})
    assert tok("hi").input_ids[0] == meta["tokenizer.ggml.bos_token_id"]


def test_bf16_file_runs_as_transformers_on_the_folder(files, reference):
    """The engine on the BF16 file (``quantization=None``) gives transformers' greedy
    tokens on the folder the file was made from, alone and batched."""
    _, bf16, _, _ = files
    want = [hf_greedy(reference, p, 8) for p in PROMPTS]
    with Engine.from_pretrained(bf16, max_model_len=128) as eng:
        assert type(eng.model).__name__ == "OlmoeForCausalLM"
        alone = eng.generate([PROMPTS[0]], max_new_tokens=8, **GREEDY)[0].token_ids
        batch = [o.token_ids for o in eng.generate(PROMPTS, max_new_tokens=8, **GREEDY)]
    assert alone == want[0]
    assert batch == want


def test_q8_0_file_runs_packed(files):
    """The loader's reader gives gguf-py's tensors. ``quantization="gguf"`` on the Q8_0
    file: experts ``QuantizedExperts`` over the file's bytes, projections and LM head ``QuantizedLinear``, router and norms float;
    logits and greedy tokens (alone and batched) of the file's de-quantised weights, whose
    values are gguf-py's de-quantisation of the file."""
    q8 = files[2]
    config, _ = config_and_tokenizer(q8)
    dense = load_dequantized(q8, config, torch.float32)
    assert dense is not None and not any(isinstance(m, QuantizedExperts) for m in dense.modules())
    tensors = {t.name: t for t in gguf.GGUFReader(str(q8)).tensors}
    _, ours = read_file(q8)  # the loader's reader: gguf-py's tensors, memory-mapped
    assert [t.name for t in ours] == list(tensors)
    for t in ours:
        want = tensors[t.name]
        assert t.tensor_type == want.tensor_type and list(t.shape) == [*reversed(want.shape.tolist())]  # fmt: skip
        np.testing.assert_array_equal(t.data, want.data)
    down = tensors["blk.1.ffn_down_exps.weight"]
    np.testing.assert_array_equal(
        dense.model.layers[1].mlp.experts.down_proj.detach().numpy(),
        gguf.quants.dequantize(down.data, down.tensor_type).reshape(
            4, SHAPE["hidden_size"], SHAPE["intermediate_size"]
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed, _ = load_gguf_packed(q8, torch.float32, GGUF_FP32_ACT)
    layer = packed.model.layers[1]
    assert isinstance(layer.mlp.experts, QuantizedExperts) and layer.mlp.experts.format == "q8_0"
    np.testing.assert_array_equal(layer.mlp.experts.qdown.numpy(), np.asarray(down.data))
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layer.self_attn, proj), QuantizedLinear), proj
    assert isinstance(packed.lm_head, QuantizedLinear)
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.self_attn.q_norm.weight.shape == (SHAPE["hidden_size"],)  # all heads' width
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(packed(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)
    want = [hf_greedy(dense, p, 8) for p in PROMPTS]
    with Engine.from_pretrained(q8, quantization=GGUF_FP32_ACT, max_model_len=128) as eng:
        assert isinstance(eng.model.model.layers[0].mlp.experts, QuantizedExperts)
        alone = eng.generate([PROMPTS[0]], max_new_tokens=8, **GREEDY)[0].token_ids
        batch = [o.token_ids for o in eng.generate(PROMPTS, max_new_tokens=8, **GREEDY)]
    assert alone == want[0]
    assert batch == want


def test_q4_k_m_file_runs_packed_where_it_can(files, caplog):
    """llama-quantize's Q4_K_M (Q4_K; Q6_K for the LM head and some V / down rows) with
    layer 0's ``attn_q`` forced to Q5_0 (what llama-quantize writes where a row holds no
    whole K-quant block) and its ``ffn_down_exps`` to IQ4_NL (no packed kernel here): the
    Q4_K / Q6_K / Q5_0 tensors run packed, layer 1's experts as Q4_K gate / up with their
    down rows' own format; the IQ4_NL one is de-quantised, as are layer 0's experts (Q4_K
    and IQ4_NL parts make no one ``QuantizedExperts``), one log line naming them; the
    logits are those of the file de-quantised."""
    folder, bf16, _, converter = files
    forced = (r"blk\.0\.attn_q=q5_0", r"blk\.0\.ffn_down_exps=iq4_nl")
    path = _quantize(bf16, "Q4_K_M", converter, folder, *forced)
    if path is None:
        pytest.skip(f"llama-quantize is not built ({binaries()['llama-quantize']})")
    kinds = {t.name: t.tensor_type.name.lower() for t in read_file(path)[1]}
    assert kinds["blk.0.attn_q.weight"] == "q5_0"
    assert kinds["blk.0.ffn_down_exps.weight"] == "iq4_nl"
    assert kinds["blk.1.ffn_gate_exps.weight"] == kinds["token_embd.weight"] == "q4_k"
    assert kinds["output.weight"] == "q6_k"
    with caplog.at_level(logging.INFO, logger="torch_topg.quant.gguf_direct"):
        model, _ = load_gguf_packed(path, torch.float32, GGUF_FP32_ACT)
    line = next(r.getMessage() for r in caplog.records if "de-quantised" in r.getMessage())
    listed = {item.split(" (")[0] for item in line.split("here: ", 1)[1].split(", ")}
    assert listed == {"blk.0.ffn_down_exps.weight", "model.layers.0.mlp.experts"}
    layers = model.model.layers
    q0 = layers[0].self_attn.q_proj
    assert isinstance(q0, QuantizedLinear) and q0.format == "q5_0"
    assert not isinstance(layers[0].mlp.experts, QuantizedExperts)
    q1, e1 = layers[1].self_attn.q_proj, layers[1].mlp.experts
    assert isinstance(q1, QuantizedLinear) and q1.format == kinds["blk.1.attn_q.weight"]
    assert isinstance(e1, QuantizedExperts) and e1.format == "q4_k"
    assert e1.down_format == kinds["blk.1.ffn_down_exps.weight"]
    assert model.lm_head.format == "q6_k" and model.model.embed_tokens.format == "q4_k"
    config, _ = config_and_tokenizer(path)
    dense = load_dequantized(path, config, torch.float32)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, dense(ids).logits, atol=1e-4, rtol=1e-4)
