"""The engine's ``quantization=`` option: what it accepts and how a loaded model is
converted (``torch_topg/engine/builder.py`` calls :func:`apply_quantization`)."""

from __future__ import annotations

import os

import torch

from torch_topg.quant.modules import quantize

#: Methods of ``Engine.from_pretrained(..., quantization=)``.
QUANTIZATIONS = (None, "gguf", "int8", "int4")
#: Keys of the dict form ``quantization={"method": ..., ...}``.
QUANTIZATION_KEYS = ("method", "int8_activations", "group_size")


def resolve_quantization(quantization: object) -> tuple[str | None, dict]:
    """``(method, options)`` of the engine's ``quantization=``: a method name, or a dict
    ``{"method": m, "int8_activations": bool, "group_size": int}``. ``int8_activations``:
    the packed linears round their inputs to int8 per block of 32 and use integer dot
    products, as llama.cpp does; on by default for ``"gguf"`` (every packed linear, the LM
    head included: llama.cpp's semantics for the same file), off by default for ``"int8"``
    and ``"int4"`` (and never on their LM head). ``group_size``: int4's groups, 64 by
    default. ``options`` always holds ``int8_activations``."""
    opts: dict = {}
    method = quantization
    if isinstance(quantization, dict):
        unknown = sorted(set(quantization) - set(QUANTIZATION_KEYS))
        if unknown:
            raise ValueError(
                f"Engine: quantization keys {unknown} are not among {list(QUANTIZATION_KEYS)}"
            )
        method = quantization.get("method")
        opts = {k: v for k, v in quantization.items() if k != "method"}
        if method is None and opts:
            raise ValueError("Engine: quantization options need a 'method'")
        if "group_size" in opts and method != "int4":
            raise ValueError("Engine: quantization group_size applies to method 'int4' only")
        if not isinstance(opts.get("int8_activations", False), bool):
            raise ValueError("Engine: quantization int8_activations must be True or False")
    if method not in QUANTIZATIONS:
        raise ValueError(
            f"Engine: quantization {method!r} is not one of "
            + ", ".join(map(repr, QUANTIZATIONS))
            + " (or a dict with 'method')"
        )
    opts.setdefault("int8_activations", method == "gguf")
    return method, opts


def apply_quantization(
    model: torch.nn.Module,
    quantization: object,
    gguf_file: str | os.PathLike[str] | None = None,
) -> torch.nn.Module:
    """``model`` with its linears packed: ``"int8"`` / ``"int4"`` (group 64) quantise its
    float weights; ``"gguf"`` swaps in ``gguf_file``'s quantised tensors as they are
    (``model`` must hold, in float32, the weights transformers de-quantised from it).
    ``quantization`` may be the dict form (:func:`resolve_quantization`)."""
    method, opts = resolve_quantization(quantization)
    act = opts["int8_activations"]
    if method is None:
        return model
    if method == "gguf":
        if gguf_file is None:
            raise ValueError(
                "Engine: quantization='gguf' needs a GGUF file (model=<path>.gguf, or None "
                "for the SmolLM2 file)"
            )
        from torch_topg.quant.gguf_model import use_gguf_weights

        if not use_gguf_weights(model, gguf_file, int8_activations=act):
            raise ValueError(f"Engine: {gguf_file} holds no quantised tensor of the model")
        return model
    return quantize(model, method, group_size=opts.get("group_size", 64), int8_activations=act)


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
