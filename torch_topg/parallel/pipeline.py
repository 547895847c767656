"""Pipeline stages: a transformers decoder cut into consecutive runs of layers.

A stage is the model itself with the other stages' parts taken out, so that the model's
own forward still runs and every kept parameter keeps its checkpoint name
(``model.layers.7.mlp.down_proj.weight`` stays that on the stage that holds layer 7):

* a decoder layer of another stage becomes a :class:`SkippedLayer` (no parameters; its
  forward hands the hidden states through), so the model's loop over ``layers`` runs
  only the stage's own and each attention keeps its global ``layer_idx``;
* the token embedding stays on the first stage (and on the last when the LM head is tied
  to it: it *is* the head's weight); later stages are called with ``inputs_embeds=`` the
  previous stage's hidden states;
* the final norm and the LM head stay on the last stage; earlier stages get an identity
  norm and no head, and return the hidden states of their last layer.

:func:`pipeline_stage` cuts a model built with ``empty_model`` (parameters on meta);
:func:`load_stage` then reads the kept parameters from a safetensors checkpoint, so a
node reads only its layers' tensors. With tensor parallelism inside the stage,
``tensor_parallel(stage, checkpoint=...)`` does the reading instead (it skips the
:class:`SkippedLayer` s).

Only families whose forward passes ``inputs_embeds`` to the first layer unchanged can be
cut this way (Gemma scales them inside the forward, so a later stage would scale twice);
the families of the tensor-parallel plans (``PLANS``) all do.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch_topg.parallel.plans import PLANS
from torch_topg.parallel.skipped import Removed, SkippedLayer


@dataclass(frozen=True)
class Stage:
    """One stage of ``num_stages``: decoder layers ``[start, end)`` (also ``model.topg_pp``)."""

    index: int
    num_stages: int
    start: int
    end: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.num_stages - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)


def split_layers(num_layers: int, num_stages: int) -> list[Stage]:
    """Consecutive, as even as possible by count; the extra layers go to the later stages
    (the first stage's process also runs the scheduler and the sampler). The engine
    splits by bytes instead (:func:`balance_layers`); this is that rule for layers of
    equal size and no LM head."""
    return balance_layers([1] * max(num_layers, 0), 0, num_stages)


def stages_of(counts: Sequence[int], num_layers: int, name: str = "pp_layers") -> list[Stage]:
    """The stages of an explicit split: ``counts[i]`` layers on stage ``i``, in order.
    A ValueError naming ``name`` when the counts are not positive or do not sum to
    ``num_layers``."""
    counts = list(counts)
    if not counts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
        raise ValueError(f"{name}: expected a list of layer counts >= 1, one per stage, got {counts!r}")  # fmt: skip
    if sum(counts) != num_layers:
        raise ValueError(
            f"{name}: {counts} sums to {sum(counts)} layers; the model has {num_layers} "
            "decoder layers (the counts, one per stage, must add up to them)"
        )
    stages, start = [], 0
    for i, n in enumerate(counts):
        stages.append(Stage(i, len(counts), start, start + n))
        start += n
    return stages


def balance_layers(layer_bytes: Sequence[int], head_bytes: int, num_stages: int) -> list[Stage]:
    """Consecutive stages whose bytes read per decode step are as equal as possible.

    ``layer_bytes[i]``: decoder layer ``i``'s weights (packed bytes where quantised);
    ``head_bytes``: what only the last stage reads whole every step (the LM head and the
    final norm). The token embedding is not counted: a step reads only the rows of its
    tokens. The split minimises the largest stage (the pipeline runs at the speed of its
    slowest stage); among the splits that reach it, the one whose stages are most even
    (least sum of squares); among those, the one with the earlier stages lighter (node 0
    also schedules and samples). Decode at these sizes is bound by reading the weights,
    so bytes are what a stage's time follows."""
    sizes = [int(b) for b in layer_bytes]
    n, s = len(sizes), num_stages
    if s < 1 or n < s:
        raise ValueError(
            f"pipeline: {n} decoder layers cannot be split over {s} stages "
            "(every stage needs at least one layer)"
        )
    if any(b < 0 for b in sizes) or head_bytes < 0:
        raise ValueError(f"pipeline: byte counts must be >= 0, got {sizes} and head {head_bytes}")
    prefix = [0]
    for b in sizes:
        prefix.append(prefix[-1] + b)

    def cost(stage: int, start: int, end: int) -> int:  # layers [start, end) on `stage`
        return prefix[end] - prefix[start] + (head_bytes if stage == s - 1 else 0)

    inf = float("inf")

    def ends(i: int, j: int) -> range:  # where stage i, starting at layer j, may end
        return range(j + 1, n - (s - i - 1) + 1)

    # worst[i][j]: the least possible largest stage of stages i.. over layers j..
    worst = [[inf] * (n + 1) for _ in range(s + 1)]
    worst[s][n] = 0
    for i in range(s - 1, -1, -1):
        for j in range(i, n - (s - i) + 1):
            worst[i][j] = min(max(cost(i, j, k), worst[i + 1][k]) for k in ends(i, j))
    bound = worst[0][0]
    # squares[i][j]: the least sum of squared stage bytes of stages i.. over layers j..,
    # every stage within the bound
    squares = [[inf] * (n + 1) for _ in range(s + 1)]
    squares[s][n] = 0
    for i in range(s - 1, -1, -1):
        for j in range(i, n - (s - i) + 1):
            for k in ends(i, j):
                if (c := cost(i, j, k)) <= bound:
                    squares[i][j] = min(squares[i][j], c * c + squares[i + 1][k])
    stages, start = [], 0
    for i in range(s):  # each stage as light as the optimum allows
        k = next(k for k in ends(i, start) if cost(i, start, k) <= bound
                 and cost(i, start, k) ** 2 + squares[i + 1][k] == squares[i][start])  # fmt: skip
        stages.append(Stage(i, s, start, k))
        start = k
    return stages


def byte_table(model: nn.Module) -> tuple[list[int], int]:
    """``(layer_bytes, head_bytes)`` of a transformers decoder (meta parameters count
    as what they will hold), for :func:`balance_layers`: each decoder layer's parameters
    and buffers (a quantised layer's packed tensors), and the LM head's weight (the
    embedding's when tied) plus the final norm."""

    def size(m: nn.Module) -> int:
        seen, total = set(), 0
        for t in [*m.parameters(), *m.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
        return total

    base = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    norm = getattr(base, "norm", None)
    head_bytes = (size(head) if head is not None else 0) + (size(norm) if norm is not None else 0)
    return [size(layer) for layer in base.layers], head_bytes


def check_pipeline_family(config: Any) -> None:
    """Refuse a family that cannot be cut into stages (see the module docstring)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in PLANS:
        raise ValueError(
            f"pipeline: no pipeline-parallel support for model_type {model_type!r} "
            f"(its forward must take inputs_embeds unchanged); supported: {sorted(PLANS)}"
        )


def pipeline_stage(model: nn.Module, stage: Stage) -> nn.Module:
    """Cut ``model`` (in place) down to ``stage``; returns it (``model.topg_pp = stage``)."""
    check_pipeline_family(model.config)
    base = getattr(model, model.base_model_prefix)
    layers = base.layers
    if stage.end > len(layers) or stage.start < 0 or stage.start >= stage.end:
        raise ValueError(f"pipeline: {stage} does not fit a model of {len(layers)} layers")
    for i in range(len(layers)):
        if i not in stage.layers:
            layers[i] = SkippedLayer(i)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = head is not None and getattr(head, "weight", None) is embed.weight
    if not stage.last:
        base.norm = nn.Identity()
        model.set_output_embeddings(Removed("the LM head"))
    if not (stage.first or (stage.last and tied)):
        model.set_input_embeddings(Removed("the token embedding"))
    model.topg_pp = stage
    return model


def load_stage(
    model: nn.Module, checkpoint: str | os.PathLike[str], dtype: torch.dtype, device: Any
) -> nn.Module:
    """Read the parameters a stage kept (and only those) from a safetensors checkpoint
    into ``model`` (built with ``empty_model`` and cut by :func:`pipeline_stage`)."""
    from torch_topg.parallel.api import _materialise, move_buffers
    from torch_topg.parallel.loading import CheckpointSource

    device = torch.device(device)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters(remove_duplicate=False)}
    source = CheckpointSource(checkpoint)
    try:
        _materialise(model, source, {}, shapes, dtype, device)
    finally:
        source.close()
    move_buffers(model, device)
    return model
