"""The safetensors format, read and written in one place (offload and tensor parallel).

A file is an 8-byte little-endian header length, a JSON header of
``name -> {dtype, shape, data_offsets}`` (plus an optional ``__metadata__``), then the
raw bytes. It is small enough to parse here, which keeps tensors zero-copy views of a
private (copy-on-write) memory map without depending on how a library version maps
files: opening a checkpoint reads nothing but the header; pages are read from storage
when a tensor is first touched.

Every header is validated before anything is mapped (:func:`parse_header`): a known
dtype, a shape whose byte size is the tensor's data span, and a span inside the file.
A truncated or corrupt file is a ``SafetensorsError`` naming the file and the tensor,
never a tensor of uninitialised memory or, later, a ``SIGBUS`` when a page past the end
of the file is touched. A file can still be truncated after it was opened (another
process rewriting it): :meth:`SafetensorsSource.check` re-reads the file size
(``os.fstat``, no I/O) and is called before a tensor is read; a truncation that lands
between that check and the read itself still faults, which only reading with
``pread`` instead of a memory map would rule out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import os
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

# safetensors dtype names <-> torch dtypes (the newer ones where this torch has them)
DTYPES: dict[str, torch.dtype] = {
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
for _name, _attr in [("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64")]:
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)
NAMES = {v: k for k, v in DTYPES.items()}
# Files we write put every tensor on a cache-line boundary (see write_safetensors).
ALIGN = 64
# Names of the filler tensors that pad our files' tensors to ALIGN (skipped on read).
PAD = "__topg_pad_"


class SafetensorsError(ValueError):
    """A safetensors file that cannot be read as it claims: malformed or truncated."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # byte offset in the file (not in the data section)
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    path: Path
    data_start: int  # 8 + the header length
    tensors: dict[str, TensorInfo]  # in header order, padding tensors included

    @property
    def required_size(self) -> int:
        """The smallest file size that holds every tensor's bytes."""
        return max((t.end for t in self.tensors.values()), default=self.data_start)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(path: str | os.PathLike[str], fd: int) -> Header:
    """Read and validate the header of the safetensors file open as ``fd``.

    Raises :class:`SafetensorsError` naming ``path`` (and the tensor, where one is at
    fault) for a file that is not safetensors, a header that is not a JSON object of
    well-formed entries, an unknown dtype, a data span that does not match its shape,
    or a tensor that ends past the end of the file (a truncated file).
    """
    path = Path(path)
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    if len(head) != 8:
        raise SafetensorsError(
            f"safetensors: {path} is not a safetensors file (shorter than 8 bytes)"
        )
    (n,) = struct.unpack("<Q", head)
    if n > size - 8:
        raise SafetensorsError(
            f"safetensors: {path}: header length {n} exceeds the file size {size} (truncated?)"
        )
    try:
        raw = json.loads(os.pread(fd, n, 8))
    except ValueError as e:
        raise SafetensorsError(f"safetensors: {path}: the header is not JSON ({e})") from e
    if not isinstance(raw, dict):
        raise SafetensorsError(f"safetensors: {path}: the header is not a JSON object")
    start = 8 + n
    tensors: dict[str, TensorInfo] = {}
    for name, info in raw.items():
        if name == "__metadata__":
            continue
        where = f"safetensors: {path}: tensor {name!r}"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
            raise SafetensorsError(f"{where}: the entry needs dtype, shape and data_offsets")
        dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise SafetensorsError(f"{where} has unsupported dtype {info['dtype']!r}")
        shape, offsets = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise SafetensorsError(f"{where}: shape {shape!r} is not a list of sizes")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise SafetensorsError(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = start + offsets[0], start + offsets[1]
        need = math.prod(shape) * dtype.itemsize
        if end - begin != need:
            raise SafetensorsError(
                f"{where}: data_offsets {offsets} hold {end - begin} bytes, its shape "
                f"{shape} of {info['dtype']} needs {need}"
            )
        if end > size:
            raise SafetensorsError(
                f"{where} lies outside the file: it ends at byte {end}, the file has "
                f"{size} bytes (truncated?)"
            )
        tensors[name] = TensorInfo(name, dtype, tuple(shape), begin, end)
    return Header(path, start, tensors)


def _views(header: Header, fd: int) -> dict[str, torch.Tensor]:
    """Every (non-padding) tensor of a validated file as a view of a private map."""
    # ACCESS_COPY: a private mapping, writable in Python's eyes (torch.frombuffer wants
    # that) but never written back; nothing is copied until a page is written.
    mm = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
    data = torch.frombuffer(mm, dtype=torch.uint8)  # keeps `mm` alive while views exist
    out: dict[str, torch.Tensor] = {}
    for name, t in header.tensors.items():
        if name.startswith(PAD):
            continue
        raw = data[t.begin : t.end]
        if t.begin % t.dtype.itemsize:
            raw = raw.clone()  # unaligned for its dtype: no view possible, copy this one
        out[name] = raw.view(t.dtype).view(t.shape)
    return out


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file as a zero-copy view of a private memory map
    (padding tensors written by :func:`write_safetensors` are left out)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        return _views(parse_header(path, fd), fd)
    finally:
        os.close(fd)  # the map holds its own reference to the file


class SafetensorsSource:
    """One or more safetensors files, validated and memory-mapped; tensors are views.

    ``extent(name)`` says where a tensor's bytes lie: (index into ``files``, byte offset
    in that file, nbytes); the offload direct-I/O reader reads them from the file itself.
    ``check(names)`` raises if a file was truncated since it was opened.
    """

    def __init__(self, files: Iterable[str | os.PathLike[str]]) -> None:
        self.files = [Path(f) for f in files]
        if not self.files:
            raise ValueError("safetensors: no file given")
        self._tensors: dict[str, torch.Tensor] = {}
        self._info: dict[str, tuple[int, TensorInfo]] = {}
        self._fds: list[int] = []
        try:
            for k, f in enumerate(self.files):
                fd = os.open(f, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._fds.append(fd)  # kept open: check() reads the size through it
                header = parse_header(f, fd)
                for name, t in _views(header, fd).items():
                    if name in self._tensors:
                        other = self.files[self._info[name][0]]
                        raise SafetensorsError(
                            f"safetensors: tensor {name!r} appears in both {other} and {f}"
                        )
                    self._tensors[name] = t
                    self._info[name] = (k, header.tensors[name])
        except BaseException:
            self.close()
            raise

    def tensor(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def names(self) -> set[str]:
        return set(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def file_of(self, name: str) -> Path:
        return self.files[self._info[name][0]]

    def extent(self, name: str) -> tuple[int, int, int]:
        """(file index, byte offset in the file, nbytes) of tensor ``name``."""
        k, t = self._info[name]
        return k, t.begin, t.end - t.begin

    def check(self, names: Iterable[str]) -> None:
        """Raise :class:`SafetensorsError` if a file shrank below the end of one of the
        tensors ``names`` since it was opened (touching such a tensor's pages would
        raise ``SIGBUS``). One ``fstat`` per file involved."""
        need: dict[int, TensorInfo] = {}
        for name in names:
            k, t = self._info[name]
            if k not in need or t.end > need[k].end:
                need[k] = t
        for k, t in need.items():
            size = os.fstat(self._fds[k]).st_size
            if size < t.end:
                raise SafetensorsError(
                    f"safetensors: {self.files[k]} is now {size} bytes but tensor "
                    f"{t.name!r} ends at byte {t.end}: the file was truncated after it "
                    "was opened"
                )

    def close(self) -> None:
        """Drop the tensors (the maps close when no view is left) and the descriptors."""
        self._tensors = {}
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def current_umask() -> int:
    """The process umask without changing it (``os.umask`` would, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o022


def write_safetensors(path: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` (any device, any strides) as a safetensors file.

    The format wants the data packed without gaps, so every tensor is placed at a
    64-byte offset in the file by a small ``uint8`` filler tensor (named
    ``__topg_pad_<k>__``, skipped by :func:`read_safetensors`) where needed: the file
    stays valid for any safetensors reader, every tensor can be viewed in place, and a
    tensor read into a page-aligned buffer (direct I/O) lands 64-byte aligned, as an
    ordinary tensor does. The data section starts 64-byte aligned (the header is padded
    with spaces, as the format allows); tensors are written largest element size first.

    Written to a fresh temporary file in the target folder (``mkstemp``: created with
    ``O_EXCL``, so never through a link planted at its name), ``fsync``ed, then renamed
    over ``path`` (a link at ``path`` is replaced, not followed): a reader sees the old
    file or the whole new one. The temporary file is removed if writing fails.
    """
    path = Path(path)
    for name, t in tensors.items():
        if t.dtype not in NAMES:
            raise ValueError(f"safetensors: cannot store {name!r} of dtype {t.dtype}")
        if name.startswith(PAD):
            raise ValueError(f"safetensors: tensor name {name!r} is reserved")
    order: list[tuple[str, torch.Tensor | None]] = []
    header: dict[str, object] = {}
    offset = 0
    for name, t in sorted(tensors.items(), key=lambda kv: -kv[1].element_size()):
        gap = -offset % ALIGN
        if gap:
            pad = f"{PAD}{len(order)}__"
            header[pad] = {"dtype": "U8", "shape": [gap], "data_offsets": [offset, offset + gap]}
            order.append((pad, None))
            offset += gap
        nbytes = t.numel() * t.element_size()
        header[name] = {
            "dtype": NAMES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        order.append((name, t))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-(8 + len(blob))) % ALIGN)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for name, t in order:
                if t is None:
                    f.write(bytes(header[name]["shape"][0]))  # type: ignore[index]
                elif t.numel():
                    f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~current_umask())  # mkstemp's 0600 -> as open() would
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable (best effort)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
