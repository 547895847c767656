"""What the engine derives from its model and options when it starts."""

from __future__ import annotations

import hashlib

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


def cache_salt(
    model: torch.nn.Module, caches: list[torch.Tensor], block_size: int, tp_rank: int = 0
) -> bytes:
    """What besides the tokens fixes a KV block's contents (the prefix hashes' root): the
    model (:func:`model_fingerprint`), the cache layout (its dtypes: the model's or the
    KV dtype's, with the scales of an int8 cache), the block size and the TP rank (each
    rank holds its own heads). Stable across processes, so engines that load the same
    weights agree on every block's hash: a router can match their KV events, and a
    shared disk tier their files."""
    layout = [(tuple(t.shape[1:]), str(t.dtype)) for t in caches]
    return repr((model_fingerprint(model), block_size, layout, tp_rank)).encode()


def model_fingerprint(model: torch.nn.Module, sample: int = 4096) -> str:
    """A short hash of the model's identity: its name, config, every tensor's name, shape
    and dtype, and the first ``sample`` values of up to 8 tensors (two random models of
    one config differ there; reading them all would take seconds on a large model)."""
    h = hashlib.blake2b(digest_size=16)
    name = getattr(model.config, "_name_or_path", "") or type(model).__name__
    h.update(repr((name, type(model).__name__)).encode())
    cfg = getattr(model, "config", None)
    try:
        h.update(cfg.to_json_string(use_diff=False).encode())
    except Exception:  # a config that does not serialise: its repr
        h.update(repr(cfg).encode())
    state = model.state_dict(keep_vars=False)
    for k, t in state.items():
        h.update(repr((k, tuple(t.shape), str(t.dtype))).encode())
    keys = list(state)
    for k in keys[:4] + keys[-4:]:
        t = state[k]
        if t.numel() == 0 or t.is_meta:  # a pipeline stage's placeholders hold no data
            continue
        # a copy: .numpy() of a view marks the weight's own storage not resizable
        head = t.detach().reshape(-1)[:sample].to("cpu", copy=True)
        h.update(head.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tp_rank() -> int:
    """This process's rank in the tensor-parallel group (0 without one)."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
