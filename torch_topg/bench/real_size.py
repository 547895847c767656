"""Models of real architectures' shapes with random weights: benchmarks at the sizes people
run (1B to 8B, and a mixture of experts) without downloading any weights.

Each shape is the published config of its model (layers, widths, heads, vocabulary, RoPE,
tied embeddings); only the weights are random. The time of a step does not depend on the
weights' values (every kernel reads every weight it is given, whatever it holds), so
speeds measured on these models are those of the real ones; their outputs are noise.

* :data:`SHAPES`: name -> (transformers config class, its fields).
* :func:`write_checkpoint`: a Hugging Face folder: ``config.json``, SmolLM2's tokenizer
  padded with added tokens to the model's real vocabulary size, and bf16 safetensors
  shards written one tensor at a time (peak memory: one tensor, not the model).
* :func:`convert_to_gguf`: the folder as a GGUF file, written by llama.cpp's own converter
  (``convert_hf_to_gguf.py`` from the sources the benchmarks build llama.cpp from); its
  quantiser (``llama-quantize``) makes the quantised files from that one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: name -> (config class in transformers, its fields). From the models' published
#: config.json files (Llama-3.2-1B, Qwen2.5-3B, Llama-3.1-8B, OLMoE-1B-7B-0924).
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3.2-1b": ("LlamaConfig", dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
    )),
    "qwen2.5-3b": ("Qwen2Config", dict(
        hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
        num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=32768,
    )),
    "llama-3.1-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
    )),
    "olmoe-1b-7b": ("OlmoeConfig", dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, num_experts=64,
        num_experts_per_tok=8, vocab_size=50304, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
        norm_topk_prob=False,
    )),
}  # fmt: skip

#: Standard deviation of the random weights (matrices); norms are ones.
WEIGHT_STD = 0.02


def config_for(name: str, **overrides: Any) -> Any:
    """The transformers config of shape ``name`` (overrides replace fields: tests shrink
    the widths)."""
    import transformers

    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}")
    cls, fields = SHAPES[name]
    cfg = getattr(transformers, cls)(**{**fields, **overrides})
    cfg.architectures = [cls.replace("Config", "ForCausalLM")]
    cfg.dtype = "bfloat16"
    return cfg


def padded_tokenizer(vocab_size: int, tokenizer_folder: str | os.PathLike[str]) -> Any:
    """SmolLM2's tokenizer (from ``tokenizer_folder``) with vocabulary entries
    ``<|extra_i|>`` up to ``vocab_size`` ids: the real model's embedding and LM head
    shapes, and a tokenizer llama.cpp's converter knows (its pre-tokenizer is SmolLM's).

    The extra entries are ordinary BPE vocabulary (no merge makes them, so no text
    encodes to them), as the unused tail of a real 128k vocabulary is; not added tokens:
    ~79k added tokens made loading the tokenizer take seconds in transformers, a cost no
    real model's file has."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder))
    missing = vocab_size - len(tok)
    if missing < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's {len(tok)} tokens")
    if missing:
        spec = json.loads(tok.backend_tokenizer.to_str())
        vocab = spec["model"]["vocab"]
        first = len(tok)
        if max(vocab.values()) >= first:
            raise ValueError("the tokenizer's vocabulary is not dense below its length")
        vocab.update({f"<|extra_{i}|>": first + i for i in range(missing)})
        backend = Tokenizer.from_str(json.dumps(spec))
        special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=tok.chat_template,
                                      clean_up_tokenization_spaces=False, **special)  # fmt: skip
    assert len(tok) == vocab_size, (len(tok), vocab_size)
    return tok


def _tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:  # norms (and biases: zeros)
        return (torch.zeros if name.endswith(".bias") else torch.ones)(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.float32)
    t.normal_(0.0, WEIGHT_STD, generator=gen)
    return t.to(torch.bfloat16)


def write_checkpoint(
    name: str,
    folder: str | os.PathLike[str],
    tokenizer_folder: str | os.PathLike[str],
    *,
    seed: int = 0,
    shard_bytes: int = 2 << 30,
    **overrides: Any,
) -> Path:
    """Write shape ``name`` with random bf16 weights to ``folder`` (a Hugging Face folder:
    config, tokenizer, ``model-0000i-of-0000n.safetensors`` and their index). Tensors are
    drawn and written one at a time (seeded per tensor name, so the same name gets the
    same values in any order). Returns the folder."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    cfg = config_for(name, **overrides)
    padded_tokenizer(cfg.vocab_size, tokenizer_folder).save_pretrained(out)
    cfg.save_pretrained(out)
    shapes = _parameter_shapes(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for n, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n in names:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(n))
            tensors[n] = _tensor(n, shapes[n], gen)
            total += tensors[n].nbytes
            weight_map[n] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return out


def _stable_hash(s: str) -> int:
    h = 0
    for ch in s.encode():
        h = (h * 131 + ch) % (1 << 31)
    return h


def _parameter_shapes(cfg: Any) -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensor names and shapes, from the model built on the meta device,
    as the published checkpoints store them: a tied LM head is not stored, and experts
    are stored one by one (``experts.<e>.gate_proj.weight``; transformers fuses them on
    load, llama.cpp's converter reads them so)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for n, p in model.state_dict().items():
        if n.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H]: per expert gate, up [I, H]
            e, i2, h = p.shape
            base = n[: -len("gate_up_proj")]
            for x in range(e):
                out[f"{base}{x}.gate_proj.weight"] = (i2 // 2, h)
                out[f"{base}{x}.up_proj.weight"] = (i2 // 2, h)
        elif n.endswith(".mlp.experts.down_proj"):  # [E, H, I]: per expert [H, I]
            base = n[: -len("down_proj")]
            for x in range(p.shape[0]):
                out[f"{base}{x}.down_proj.weight"] = tuple(p.shape[1:])
        else:
            out[n] = tuple(p.shape)
    if getattr(cfg, "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out


def convert_to_gguf(
    folder: str | os.PathLike[str],
    out: str | os.PathLike[str],
    converter: str | os.PathLike[str],
    *,
    outtype: str = "bf16",
    pre_tokenizer: str | None = "smollm",
    timeout: float = 3600,
) -> Path:
    """``folder`` as a GGUF file ``out`` by llama.cpp's ``convert_hf_to_gguf.py`` (at
    ``converter``; it uses the gguf-py beside it). Raises RuntimeError with its output's
    tail if it fails.

    ``pre_tokenizer``: the name the file records for the tokenizer's pre-tokenizer. The
    converter recognises a BPE tokenizer by hashing how it tokenizes a fixed text, and
    transformers tokenizes with the model type's own tokenizer class (Qwen2's for a
    Qwen2 config), so SmolLM2's padded vocabulary under a Qwen2 shape hashes to nothing
    it knows. The converter then runs with that lookup answering ``pre_tokenizer``
    (SmolLM2's: ``smollm``); None runs it unchanged."""
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    args = [str(folder), "--outfile", str(tmp), "--outtype", outtype]
    if pre_tokenizer is None:
        cmd = [sys.executable, str(converter), *args]
    else:
        run = (
            "import sys, runpy; sys.path.insert(0, sys.argv[1]); "
            "import conversion.base as b; "
            f"b.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre_tokenizer!r}; "
            "sys.argv = sys.argv[2:]; runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        cmd = [sys.executable, "-c", run, str(Path(converter).parent), str(converter), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        tail = (r.stdout + r.stderr)[-1500:]
        raise RuntimeError(f"convert_hf_to_gguf.py exited {r.returncode}: {tail}")
    tmp.rename(out)
    return out
