"""Where offloaded weights live between uses: host tensors or memory-mapped safetensors.

A source maps a tensor name to a CPU tensor the reader copies from. For safetensors files
(:class:`SafetensorsSource`, shared with tensor parallel's checkpoint loading in
``torch_topg/utils/safetensors_file.py``) the tensors are zero-copy views of a private
(copy-on-write) memory map, so opening a checkpoint reads nothing but the validated
headers: pages are read from storage when the reader first touches them. Before each
layer is read the engine calls the source's ``check`` (an ``fstat`` per file), so a file
truncated after it was opened is an error naming the layer, not a ``SIGBUS``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from torch_topg.utils.safetensors_file import (
    SafetensorsError,
    SafetensorsSource,
    read_safetensors,
    write_safetensors,
)

__all__ = [
    "MemorySource",
    "SafetensorsError",
    "SafetensorsSource",
    "WeightSource",
    "checkpoint_files",
    "read_safetensors",
    "write_safetensors",
]


class WeightSource(Protocol):
    """Name -> CPU tensor (read-only by contract: the reader only copies from it)."""

    def tensor(self, name: str) -> torch.Tensor: ...

    def names(self) -> set[str]: ...

    def check(self, names: Iterable[str]) -> None:
        """Raise if the bytes of ``names`` can no longer be read (a truncated file)."""

    def close(self) -> None:
        """Drop references to the tensors (memory maps close when no view is left)."""


class MemorySource(WeightSource):
    """Weights held in host memory (source="cpu"); optionally pinned for CUDA copies."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def names(self) -> set[str]:
        return set(self._tensors)

    def check(self, names: Iterable[str]) -> None:
        pass  # host memory cannot shrink under us

    def close(self) -> None:
        self._tensors = {}


def checkpoint_files(path: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files of a checkpoint: a file, or every ``*.safetensors`` in a folder."""
    p = Path(path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(p.glob("*.safetensors"))
        if files:
            return files
        raise ValueError(f"offload: source folder {str(p)!r} holds no *.safetensors file")
    raise ValueError(
        f"offload: source must be 'cpu', 'disk' or a safetensors file or folder; "
        f"{str(p)!r} does not exist"
    )
