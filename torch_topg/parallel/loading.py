"""Where shards come from: a full state dict, a safetensors checkpoint, or the model's own
(full) parameters; and :func:`empty_model`, a model whose parameters take no memory.

A shard is described by a :class:`Slice`: the checkpoint name, the dimension and one or
more ``[start, end)`` ranges concatenated along it (gate and up rows of a fused expert
``gate_up_proj`` are two ranges). A safetensors source reads each range with
``safe_open(...).get_slice(name)[...]``, so a rank reads only its shard's bytes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class Slice:
    """``ranges`` (``[start, end)``) of ``name`` along ``dim``, concatenated; no ranges:
    the whole tensor (a replicated parameter)."""

    name: str
    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()


class Source:
    """Reads :class:`Slice` s of named tensors."""

    def read(self, s: Slice) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorSource(Source):
    """A mapping of full tensors (a state dict, or the model's own parameters)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], what: str = "state_dict") -> None:
        self.tensors, self.what = tensors, what

    def read(self, s: Slice) -> torch.Tensor:
        t = self.tensors.get(s.name)
        if t is None:
            raise KeyError(f"tensor_parallel: '{s.name}' is missing from {self.what}")
        if t.device.type == "meta":
            raise ValueError(
                f"tensor_parallel: '{s.name}' is on the meta device (an empty model): pass "
                "state_dict= or checkpoint= to load its weights"
            )
        if not s.ranges:
            return t
        parts = [t.narrow(s.dim, a, b - a) for a, b in s.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, s.dim)


class SafetensorsSource(Source):
    """One ``.safetensors`` file, a folder with ``model.safetensors`` or with a
    ``model.safetensors.index.json`` (sharded checkpoint)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from safetensors import safe_open

        p = Path(path)
        index = p / "model.safetensors.index.json" if p.is_dir() else None
        if index is not None and index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            self._files = {f: safe_open(str(p / f), framework="pt") for f in files}
            self._where = {k: self._files[f] for k, f in weight_map.items()}
        else:
            file = p / "model.safetensors" if p.is_dir() else p
            if not file.exists():
                raise FileNotFoundError(f"tensor_parallel: checkpoint '{file}' does not exist")
            h = safe_open(str(file), framework="pt")
            self._files = {file.name: h}
            self._where = {k: h for k in h.keys()}
        self.path = str(p)

    def read(self, s: Slice) -> torch.Tensor:
        h = self._where.get(s.name)
        if h is None:
            raise KeyError(f"tensor_parallel: '{s.name}' is missing from checkpoint {self.path}")
        if not s.ranges:
            return h.get_tensor(s.name)
        sl = h.get_slice(s.name)
        ndim = len(sl.get_shape())
        parts = []
        for a, b in s.ranges:
            index = [slice(None)] * ndim
            index[s.dim] = slice(a, b)
            parts.append(sl[tuple(index)])
        return parts[0] if len(parts) == 1 else torch.cat(parts, s.dim)

    def close(self) -> None:
        self._files.clear()
        self._where.clear()


def make_source(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    checkpoint: str | os.PathLike[str] | None,
) -> Source:
    if state_dict is not None and checkpoint is not None:
        raise ValueError("tensor_parallel: pass state_dict= or checkpoint=, not both")
    if checkpoint is not None:
        return SafetensorsSource(checkpoint)
    if state_dict is not None:
        return TensorSource(state_dict)
    # the model's own full tensors (kept referenced until every shard is copied)
    return TensorSource(
        {**dict(model.named_parameters(remove_duplicate=False))}, "the model's parameters"
    )


@contextmanager
def _params_on_meta() -> Iterator[None]:
    """Parameters created inside are on the meta device; buffers stay real (rotary
    ``inv_freq`` and friends are computed in ``__init__`` and not saved in checkpoints)."""
    original = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: Any) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def empty_model(config: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A transformers causal LM for ``config`` whose parameters are on the meta device
    (no memory, no initialisation); buffers are real. Pass it to ``tensor_parallel``
    with ``state_dict=`` or ``checkpoint=``: each rank then allocates only its shard."""
    import transformers

    with _params_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()
