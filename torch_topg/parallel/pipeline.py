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
    """Consecutive, as even as possible; the extra layers go to the later stages (the
    first stage's process also runs the scheduler and the sampler)."""
    if num_stages < 1 or num_layers < num_stages:
        raise ValueError(
            f"pipeline: {num_layers} decoder layers cannot be split over {num_stages} "
            "stages (every stage needs at least one layer)"
        )
    base, extra = divmod(num_layers, num_stages)
    sizes = [base + (1 if i >= num_stages - extra else 0) for i in range(num_stages)]
    stages, start = [], 0
    for i, n in enumerate(sizes):
        stages.append(Stage(i, num_stages, start, start + n))
        start += n
    return stages


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
