"""Where shards come from: a full state dict, a safetensors checkpoint, or the model's own
(full) parameters; and :func:`empty_model`, a model whose parameters take no memory.

A shard is described by a :class:`Slice`: the checkpoint name, the dimension and one or
more ``[start, end)`` ranges concatenated along it (gate and up rows of a fused expert
``gate_up_proj`` are two ranges). A checkpoint is read through the shared safetensors
reader (``torch_topg/utils/safetensors_file.py``: headers validated, files
memory-mapped), each range copied out of its tensor's view, so a rank reads only the
pages of its shard.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torch_topg.utils.safetensors_file import SafetensorsSource


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


class CheckpointSource(Source):
    """One ``.safetensors`` file, a folder with ``model.safetensors`` or with a
    ``model.safetensors.index.json`` (sharded checkpoint), read through the shared
    safetensors reader (headers validated, files memory-mapped)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        index = p / "model.safetensors.index.json" if p.is_dir() else None
        weight_map: dict[str, str] = {}
        where: dict[str, Path] = {}
        if index is not None and index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"tensor_parallel: {index} is not a weight index ({e})") from e
            if not isinstance(weight_map, dict):
                raise ValueError(f"tensor_parallel: {index}: weight_map is not an object")
            for f in weight_map.values():
                if not isinstance(f, str) or f not in where:
                    where[f] = _inside(p, f, index)  # raises for a name that is not a str
            files = sorted(set(where.values()))
        else:
            file = p / "model.safetensors" if p.is_dir() else p
            if not file.exists():
                raise FileNotFoundError(f"tensor_parallel: checkpoint '{file}' does not exist")
            files = [file]
        self.st = SafetensorsSource(files)
        for name, f in weight_map.items():
            if name not in self.st or self.st.file_of(name) != where[f]:
                self.st.close()
                raise ValueError(
                    f"tensor_parallel: {index} puts '{name}' in {f}, which does not hold it"
                )
        self.path = str(p)

    def read(self, s: Slice) -> torch.Tensor:
        if s.name not in self.st:
            legacy = _per_expert(self.st, s)
            if legacy is not None:
                return legacy
            raise KeyError(f"tensor_parallel: '{s.name}' is missing from checkpoint {self.path}")
        self.st.check([s.name])  # truncated since it was opened: an error, not SIGBUS
        t = self.st.tensor(s.name)
        parts = [t.narrow(s.dim, a, b - a) for a, b in s.ranges] or [t]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, s.dim)
        # a copy (cat already made one): the model never holds views of the map
        return out if len(parts) > 1 else out.clone(memory_format=torch.contiguous_format)

    def close(self) -> None:
        self.st.close()


#: Per-expert checkpoint names (gate, up, down) of transformers 5's fused experts: the
#: layout Mixtral / Qwen-MoE checkpoints on the Hub have, and the one transformers 5's
#: ``save_pretrained`` still writes (it converts back on save).
_PER_EXPERT = (
    ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
     "block_sparse_moe.experts.{e}.w2.weight"),
    ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
     "mlp.experts.{e}.down_proj.weight"),
)  # fmt: skip
#: Renamed modules: the fused model's name -> the checkpoint's (Mixtral's router).
_RENAMED = (("mlp.gate.weight", "block_sparse_moe.gate.weight"),)


def _per_expert(st: SafetensorsSource, s: Slice) -> torch.Tensor | None:
    """``s`` of a fused experts tensor (``<layer>.mlp.experts.gate_up_proj`` ``[E, 2I, H]``
    or ``down_proj`` ``[E, H, I]``) built from a per-expert checkpoint, each expert's rows
    sliced before they are stacked (no full copy of the layer); or a renamed tensor. None:
    the checkpoint has neither."""
    for new, old in _RENAMED:
        if s.name.endswith(new) and (alt := s.name[: -len(new)] + old) in st:
            st.check([alt])
            t = st.tensor(alt)
            parts = [t.narrow(s.dim, a, b - a) for a, b in s.ranges] or [t]
            return torch.cat(parts, s.dim) if len(parts) > 1 else parts[0].clone()
    m = re.fullmatch(r"(.+\.)mlp\.experts\.(gate_up_proj|down_proj)", s.name)
    if m is None:
        return None
    prefix, which = m.groups()
    for gate, up, down in _PER_EXPERT:
        if prefix + gate.format(e=0) not in st:
            continue
        n = 0
        while prefix + gate.format(e=n) in st:
            n += 1
        if s.ranges and s.dim not in (1, 2):
            raise ValueError(f"tensor_parallel: '{s.name}' sliced along dim {s.dim} (experts)")
        kinds = (down,) if which == "down_proj" else (gate, up)
        st.check([prefix + k.format(e=e) for e in range(n) for k in kinds])
        experts = []
        for e in range(n):
            if which == "down_proj":  # [H, I]: ranges along I (dim 2 of the fused tensor)
                d = st.tensor(prefix + down.format(e=e))
                parts = [d.narrow(1, a, b - a) for a, b in s.ranges] or [d]
            else:  # [gate; up] rows: ranges along 2I (dim 1)
                g, u = st.tensor(prefix + gate.format(e=e)), st.tensor(prefix + up.format(e=e))
                inter = g.shape[0]
                parts = []
                for a, b in s.ranges or ((0, 2 * inter),):
                    if a < inter:
                        parts.append(g[a : min(b, inter)])
                    if b > inter:
                        parts.append(u[max(a, inter) - inter : b - inter])
            experts.append(torch.cat(parts, 1 if which == "down_proj" else 0))
        return torch.stack(experts)
    return None


def _inside(folder: Path, name: object, index: Path | None) -> Path:
    """``folder / name`` for a file name read from the weight index, refused unless it
    stays inside ``folder``: a relative path without ``..`` whose folder resolves
    (symlinks followed) under ``folder``. The file itself may be a symlink, as every
    file of a Hugging Face cache snapshot is (into ``../../blobs``)."""
    bad = not isinstance(name, str) or not name
    if not bad:
        rel = Path(name)  # type: ignore[arg-type]
        bad = rel.is_absolute() or ".." in rel.parts
    if not bad:
        parent = (folder / rel).parent.resolve()
        bad = not parent.is_relative_to(folder.resolve())
    if bad:
        raise ValueError(
            f"tensor_parallel: {index} names file {name!r} outside the checkpoint folder "
            f"{folder}; weight_map entries must be file names inside it"
        )
    return folder / rel


def make_source(
    model: nn.Module,
    state_dict: Mapping[str, torch.Tensor] | None,
    checkpoint: str | os.PathLike[str] | None,
) -> Source:
    if state_dict is not None and checkpoint is not None:
        raise ValueError("tensor_parallel: pass state_dict= or checkpoint=, not both")
    if checkpoint is not None:
        return CheckpointSource(checkpoint)
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
