"""Where offloaded weights live between uses: host tensors or memory-mapped safetensors.

A source maps a tensor name to a CPU tensor the reader copies from. For safetensors files
the tensors are zero-copy views of a private (copy-on-write) memory map, so opening a
checkpoint reads nothing: pages are read from storage when the reader first touches them.

The safetensors format is small enough to parse here (an 8-byte little-endian header
length, a JSON header of ``name -> {dtype, shape, data_offsets}``, then the raw bytes),
which keeps the views zero-copy without depending on how a library version maps files.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

# safetensors dtype names <-> torch dtypes
_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
# Files we write put every tensor on a cache-line boundary (see write_safetensors).
_ALIGN = 64
# Names of the filler tensors that pad our files' tensors to _ALIGN (skipped on read).
_PAD = "__topg_pad_"


class WeightSource:
    """Name -> CPU tensor (read-only by contract: the reader only copies from it)."""

    def tensor(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def names(self) -> set[str]:
        raise NotImplementedError

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

    def close(self) -> None:
        self._tensors = {}


class SafetensorsSource(WeightSource):
    """One or more safetensors files, memory-mapped; tensors are views of the maps.

    ``extent(name)`` says where a tensor's bytes lie: (index into ``files``, byte offset
    in that file, nbytes); the direct-I/O reader reads them from the file itself.
    """

    def __init__(self, files: Iterable[str | os.PathLike[str]]) -> None:
        self._tensors: dict[str, torch.Tensor] = {}
        self._extents: dict[str, tuple[int, int, int]] = {}
        self.files = [Path(f) for f in files]
        if not self.files:
            raise ValueError("offload: source names no safetensors file")
        for k, f in enumerate(self.files):
            spans: dict[str, tuple[int, int]] = {}
            for name, t in read_safetensors(f, spans).items():
                if name in self._tensors:
                    raise ValueError(f"offload: source tensor {name!r} appears in two files")
                self._tensors[name] = t
            for name, (off, nbytes) in spans.items():
                self._extents[name] = (k, off, nbytes)

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def extent(self, name: str) -> tuple[int, int, int]:
        """(file index, byte offset in the file, nbytes) of tensor ``name``."""
        return self._extents[name]

    def names(self) -> set[str]:
        return set(self._tensors)

    def close(self) -> None:
        self._tensors = {}


def read_safetensors(
    path: str | os.PathLike[str], spans: dict[str, tuple[int, int]] | None = None
) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a zero-copy view of a private memory map.

    ``spans``, if given, receives ``name -> (byte offset in the file, nbytes)``.
    Padding tensors written by :func:`write_safetensors` are left out.
    """
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"offload: {path} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if n > size - 8:
            raise ValueError(f"offload: {path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"offload: {path}: the safetensors header is not JSON ({e})") from e
        if size == 8 + n:  # header only (no tensor or only empty tensors): nothing to map
            return {
                k: torch.empty(v["shape"], dtype=_DTYPES[v["dtype"]])
                for k, v in header.items()
                if k != "__metadata__" and not k.startswith(_PAD)
            }
        # ACCESS_COPY: a private mapping, writable in Python's eyes (torch.frombuffer
        # wants that) but never written back; nothing is copied until a page is written.
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive while views exist
    out: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name == "__metadata__" or name.startswith(_PAD):
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(
                f"offload: {path}: tensor {name!r} has unsupported dtype {info['dtype']}"
            )
        dtype = _DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        begin += 8 + n
        end += 8 + n
        if not (8 + n <= begin <= end <= size):
            raise ValueError(f"offload: {path}: tensor {name!r} lies outside the file")
        if spans is not None:
            spans[name] = (begin, end - begin)
        raw = data[begin:end]
        if raw.numel() % dtype.itemsize or (begin % dtype.itemsize):
            # unaligned for its dtype: a view cannot be taken, copy this one tensor
            raw = raw.clone()
        out[name] = raw.view(dtype).view(info["shape"])
    return out


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` (any device, any strides) as a safetensors file.

    The format wants the data packed without gaps, so every tensor is placed at a
    64-byte offset in the file by a small ``uint8`` filler tensor (named
    ``__topg_pad_<k>__``, skipped by :func:`read_safetensors`) where needed: the file
    stays valid for any safetensors reader, every tensor can be viewed in place, and a
    tensor read into a page-aligned buffer (direct I/O) lands 64-byte aligned, as an
    ordinary tensor does. The data section starts 64-byte aligned (the header is padded
    with spaces, as the format allows); tensors are written largest element size first.
    Written to a temporary name and renamed, so a reader never sees half a file.
    """
    path = Path(path)
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise ValueError(f"offload: cannot store {name!r} of dtype {t.dtype} in safetensors")
        if name.startswith(_PAD):
            raise ValueError(f"offload: tensor name {name!r} is reserved")
    order: list[tuple[str, torch.Tensor | None]] = []
    header: dict[str, object] = {}
    offset = 0
    for name, t in sorted(tensors.items(), key=lambda kv: -kv[1].element_size()):
        gap = -offset % _ALIGN
        if gap:
            pad = f"{_PAD}{len(order)}__"
            header[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            order.append((pad, None))
            offset += gap
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": _NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        order.append((name, t))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-(8 + len(blob))) % _ALIGN)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, t in order:
            if t is None:
                f.write(bytes(header[name]["shape"][0]))  # type: ignore[index]
            elif t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    os.replace(tmp, path)


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
