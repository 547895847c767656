"""What the engine derives from its model and options when it starts."""

from __future__ import annotations

import torch

from torch_topg.engine.config import EngineConfig


def decode_plan_wanted(config: EngineConfig) -> bool | str:
    """True, or why decode batches stay on the compiled graph (docs/decode-step.md)."""
    args = config.args
    if not args.decode_plan:
        return "decode_plan=False"
    if args.prefetch_depth > 0:
        return "prefetch_depth > 0: offloaded layers stream their weights on the compiled graph"
    if args.nnodes > 1:
        return "nnodes > 1: each node runs its pipeline stage on the compiled graph"
    if args.tp_size > 1:
        return "tp_size > 1: each rank runs its shard on the compiled graph"
    if args.deterministic:
        return "deterministic=True: batch-invariant kernels run on the compiled graph"
    if config.device.type not in ("cpu", "cuda"):
        return f"device {config.device.type}: no decode plan (CPU) or CUDA graphs for it"
    return True


def logits_width(model: torch.nn.Module) -> int:
    """Columns of the model's logits (its ``lm_head``; may exceed the tokenizer's vocabulary)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    width = getattr(head, "out_features", None) or getattr(head, "num_embeddings", None)
    return int(width or model.config.get_text_config().vocab_size)


def cache_salt(model: torch.nn.Module, caches: list[torch.Tensor], block_size: int) -> bytes:
    """What besides the tokens fixes a KV block's contents (the prefix hashes' root)."""
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    layout = [(tuple(t.shape[1:]), str(t.dtype)) for t in caches]
    return repr((name, id(model), block_size, layout)).encode()
