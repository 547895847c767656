"""The engine's ``quantization=`` option: what it accepts and how a loaded model is
converted (``torch_topg/engine/builder.py`` calls :func:`apply_quantization`)."""

from __future__ import annotations

import os

import torch

from torch_topg.quant.modules import quantize

#: Values of ``Engine.from_pretrained(..., quantization=)``.
QUANTIZATIONS = (None, "gguf", "int8", "int4")


def check_quantization(quantization: object) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"Engine: quantization {quantization!r} is not one of "
            + ", ".join(map(repr, QUANTIZATIONS))
        )


def apply_quantization(
    model: torch.nn.Module,
    quantization: str | None,
    gguf_file: str | os.PathLike[str] | None = None,
) -> torch.nn.Module:
    """``model`` with its linears packed: ``"int8"`` / ``"int4"`` (group 64) quantise its
    float weights; ``"gguf"`` swaps in ``gguf_file``'s quantised tensors as they are
    (``model`` must hold, in float32, the weights transformers de-quantised from it)."""
    check_quantization(quantization)
    if quantization is None:
        return model
    if quantization == "gguf":
        if gguf_file is None:
            raise ValueError(
                "Engine: quantization='gguf' needs a GGUF file (model=<path>.gguf, or None "
                "for the SmolLM2 file)"
            )
        from torch_topg.quant.gguf_model import use_gguf_weights

        if not use_gguf_weights(model, gguf_file):
            raise ValueError(f"Engine: {gguf_file} holds no quantised tensor of the model")
        return model
    return quantize(model, quantization, group_size=64)


def gguf_file(model: str | os.PathLike[str] | None) -> str:
    """The GGUF file behind the engine's ``model`` argument (None: SmolLM2's)."""
    if model is None:
        from torch_topg.models.hf import gguf_path

        return str(gguf_path())
    if not str(model).endswith(".gguf"):
        raise ValueError(
            f"Engine: quantization='gguf' needs a .gguf file or None (SmolLM2), got {model!r}"
        )
    return str(model)
