"""``tensor_parallel(model, ...)``: shard a transformers model over a process group."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from torch_topg.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    reduce_output,
)
from torch_topg.parallel.loading import Slice, make_source
from torch_topg.parallel.plans import Layout, make_layout, plan_for, plan_layer
from torch_topg.parallel.sharding import normalize_ratios, shard_range
from torch_topg.parallel.skipped import SkippedLayer
from torch_topg.utils.distributed import publish_failure


def tensor_parallel(
    model: nn.Module,
    tp_size: int | None = None,
    process_group: dist.ProcessGroup | None = None,
    split_ratios: Sequence[float] | None = None,
    *,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Shards ``model`` (in place) over ``process_group``; returns it.

    Args:
        model: a transformers causal LM of a family in ``PLANS`` (Llama, Mistral, Qwen2,
            Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE). Either materialised (its own weights
            are sharded, the full tensors freed once nothing else holds them) or built
            with :func:`empty_model` (parameters on the meta device) together with
            ``state_dict`` or ``checkpoint``.
        tp_size: the number of ranks; must equal the group's size (checked) when given.
        process_group: default: the default (world) group. Every rank calls this.
        split_ratios: one positive weight per rank (e.g. ``[0.6, 0.4]``), normalised.
            Heads go as whole KV groups, other sizes in aligned blocks (see
            ``torch_topg.parallel.sharding``). None: as even as whole heads allow (9
            heads over 2 ranks: 6 + 3); the realised split is ``model.topg_tp``.
        state_dict: full tensors by parameter name; each rank copies only its slices.
        checkpoint: a ``.safetensors`` file or a folder (``model.safetensors`` or a
            sharded ``model.safetensors.index.json``); each rank reads only its slices.
        device: where the shards live (default: the model's device, CPU for meta).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "tensor_parallel: torch.distributed is not initialised; call "
            "torch.distributed.init_process_group (e.g. under torchrun) or "
            "torch_topg.parallel.init_distributed() first"
        )
    pg = process_group if process_group is not None else dist.group.WORLD
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    if tp_size is not None and tp_size != world:
        raise ValueError(
            f"tensor_parallel: tp_size={tp_size} but the process group has {world} ranks "
            "(pass a process_group of tp_size ranks)"
        )
    if getattr(model, "topg_tp", None) is not None:
        raise ValueError("tensor_parallel: this model is already sharded")
    plan = plan_for(model)
    lay = make_layout(model, rank, world, pg.group_name, normalize_ratios(split_ratios, world))
    source = make_source(model, state_dict, checkpoint)
    params = list(model.parameters())
    dtype = next((p.dtype for p in params if p.is_floating_point()), torch.float32)
    if device is None:
        device = "cpu" if params[0].device.type == "meta" else params[0].device
    full_shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}

    mods: dict[str, tuple[str, Any]] = {}
    specs: dict[str, Slice] = {}
    layers = model.get_submodule(plan.layers)
    for i, layer in enumerate(layers):
        if isinstance(layer, SkippedLayer):  # a pipeline stage: another stage's layer
            continue
        m, s = plan_layer(plan, f"{plan.layers}.{i}", layer, lay)
        mods.update(m)
        specs.update(s)
    _install(model, plan, lay, mods, specs, dtype)
    try:
        _materialise(model, source, specs, full_shapes, dtype, torch.device(device))
    finally:
        source.close()
    move_buffers(model, torch.device(device))
    model.topg_tp = lay
    return model


def move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers (rotary ``inv_freq``...) follow the parameters to ``device``; a buffer left
    on the meta device is an error (the model was not built with ``empty_model``)."""
    for module in model.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device.type != "meta" and b.device != device:
                module._buffers[name] = b.to(device)
    meta = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta:
        raise ValueError(
            f"tensor_parallel: buffers {meta[:3]} are on the meta device; build the model "
            "with torch_topg.parallel.empty_model(config) (parameters on meta, buffers real)"
        )


def _install(
    model: nn.Module,
    plan: Any,
    lay: Layout,
    mods: dict[str, tuple[str, Any]],
    specs: dict[str, Slice],
    dtype: torch.dtype,
) -> None:
    """Swaps in the parallel modules (parameters on meta until materialised)."""
    g = lay.group_name
    for path, (kind, args) in mods.items():
        if kind == "column":
            lin, rng = args
            new: nn.Module = ColumnParallelLinear(
                lin.in_features, lin.out_features, rng, lin.bias is not None, dtype=dtype
            )
            model.set_submodule(path, new)
        elif kind == "row":
            lin, rng, reduce = args
            new = RowParallelLinear(
                lin.in_features, lin.out_features, rng, g, lin.bias is not None,
                reduce=reduce, dtype=dtype,
            )  # fmt: skip
            model.set_submodule(path, new)
        elif kind == "attention":
            attn = model.get_submodule(path)
            for attr, value in zip(("num_heads", "num_key_value_heads"), args, strict=True):
                if hasattr(attn, attr):  # older transformers keep per-module head counts
                    setattr(attn, attr, value)
        elif kind == "experts":
            experts = model.get_submodule(path)
            if hasattr(experts, "intermediate_dim"):
                experts.intermediate_dim = args[0]
        elif kind == "reduce_output":
            reduce_output(model.get_submodule(path), g)
    # a pipeline stage may hold neither (pipeline.py: Removed modules have no weight)
    embed = model.get_submodule(plan.embed)
    embed = embed if hasattr(embed, "weight") else None
    head = model.get_submodule(plan.lm_head) if plan.lm_head else None
    head = head if hasattr(head, "weight") else None
    tied = head is not None and embed is not None and head.weight is embed.weight
    rng = shard_range(lay.vocab, lay.rank)
    new_embed = None
    if embed is not None:
        vocab, hidden = embed.weight.shape
        new_embed = VocabParallelEmbedding(vocab, hidden, rng, g, dtype=dtype)
        model.set_submodule(plan.embed, new_embed)
        specs[f"{plan.embed}.weight"] = Slice(f"{plan.embed}.weight", 0, (rng,))
    if head is not None:
        if getattr(head, "bias", None) is not None:
            raise ValueError("tensor_parallel: an LM head with a bias is not supported")
        vocab, hidden = head.weight.shape
        weight = new_embed.weight if tied and new_embed is not None else None
        new_head = ParallelLMHead(hidden, vocab, rng, g, weight, dtype=dtype)
        model.set_submodule(plan.lm_head, new_head)
        if not tied:
            specs[f"{plan.lm_head}.weight"] = Slice(f"{plan.lm_head}.weight", 0, (rng,))


def _materialise(
    model: nn.Module,
    source: Any,
    specs: dict[str, Slice],
    full_shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """Gives every parameter its real data: its slice (sharded) or the whole tensor."""
    done: dict[int, nn.Parameter] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) in done:  # tied: the same Parameter as an earlier name
                module._parameters[pname] = done[id(p)]
                continue
            name = f"{mod_name}.{pname}" if mod_name else pname
            spec = specs.get(name, Slice(name))
            t = source.read(spec)
            shape = list(full_shapes.get(name, t.shape))
            if spec.ranges:
                shape[spec.dim] = sum(b - a for a, b in spec.ranges)
            if tuple(t.shape) != tuple(shape):
                raise ValueError(
                    f"tensor_parallel: '{name}' read as {tuple(t.shape)}, expected "
                    f"{tuple(shape)} (checkpoint does not match the model's config)"
                )
            keep_dtype = t.dtype if not t.is_floating_point() else dtype
            new_t = t.to(device=device, dtype=keep_dtype)
            if spec.ranges and new_t.data_ptr() == t.data_ptr():  # a view of a full tensor
                new_t = new_t.clone(memory_format=torch.contiguous_format)
            new = nn.Parameter(new_t.contiguous(), requires_grad=False)
            done[id(p)] = new
            module._parameters[pname] = new


def init_distributed(backend: str | None = None, timeout_s: float = 120.0) -> dist.ProcessGroup:
    """``init_process_group`` from torchrun's environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``...), with a bounded timeout so a lost peer is an error, not a hang.
    ``backend``: default ``"nccl"`` when CUDA is available, else ``"gloo"``."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise RuntimeError(
                "init_distributed: no RANK in the environment; launch with torchrun "
                "(torchrun --nproc-per-node 2 script.py) or call init_process_group"
            )
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":  # one GPU per rank (NCCL needs the current device set)
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return dist.group.WORLD


@contextmanager
def failure_guard() -> Iterator[None]:
    """Wrap a rank's work in it: an exception is published to the group's store before
    it propagates, so the other ranks' collectives fail with this rank's error message
    (``topg::all_reduce: ... another rank failed (rank 1: ValueError: ...)``) instead of
    only 'connection closed', or a hang."""
    try:
        yield
    except BaseException as e:
        publish_failure(e)
        raise
