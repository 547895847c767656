"""Direct I/O (``io="direct"``): layers are read from the safetensors files with
``O_DIRECT``, straight into the pool, instead of being copied out of a memory map.

With ``O_DIRECT`` the storage device moves the bytes into the slot by DMA: no CPU copy
(the memory-map path's memmove competes with the compute threads for cores and memory
bandwidth) and no second copy in the page cache. The price is alignment: file offset,
length and buffer address must be multiples of the logical block size (the page size
is used, which covers every common device). So a layer's tensors are read as
page-aligned regions of the file (tensors contiguous in one file are coalesced into one
region) and each tensor's view starts inside its region at ``offset % PAGE``; slot
buffers start on a page. A tensor's view is then as aligned as its offset in the file:
files written by ``write_safetensors`` put every tensor at a 64-byte offset, and a
checkpoint whose offloaded tensors are not 64-byte aligned is read through the memory
map instead (the kernels must see the alignment of an ordinary tensor to be bitwise
those of the resident model).
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from torch_topg.offload.pool import ALIGN, Entry, Read, SlotLayout
from torch_topg.offload.reader import CHUNK, Cancelled, CpuBackend, Job, Throttle

PAGE = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)

Extent = tuple[int, int, int]  # (file index, byte offset in the file, nbytes)


def probe(path: str | os.PathLike[str]) -> str | None:
    """None if ``path`` can be read with O_DIRECT (one aligned block is read), else why not."""
    if not O_DIRECT or not hasattr(os, "preadv"):
        return "this platform has no O_DIRECT / preadv"
    try:
        fd = os.open(path, os.O_RDONLY | O_DIRECT)
    except OSError as e:
        return f"{path}: the file system refuses O_DIRECT ({e.strerror})"
    buf = mmap.mmap(-1, PAGE)  # anonymous maps are page-aligned
    try:
        os.preadv(fd, [buf], 0)
    except OSError as e:
        return f"{path}: an O_DIRECT read failed ({e.strerror})"
    finally:
        os.close(fd)
        buf.close()
    return None


def misaligned(named: Sequence[tuple[str, torch.Tensor]], extent: Callable[[str], Extent]) -> str:
    """Why the tensors cannot be read directly with ordinary alignment ("" if they can)."""
    for name, _ in named:
        _, off, _ = extent(name)
        if off % ALIGN:
            return f"tensor {name!r} lies at file offset {off}, not a multiple of {ALIGN}"
    return ""


def layout(
    named: Sequence[tuple[str, torch.Tensor]], extent: Callable[[str], Extent]
) -> SlotLayout:
    """The slot layout of one layer read by direct I/O: page-aligned file regions, the
    tensors contiguous in one file coalesced; entries stay in ``named`` order."""
    spans = sorted((extent(name), name) for name, _ in named)
    where: dict[str, int] = {}
    reads: list[Read] = []
    cur = 0  # next free (page-aligned) slot offset
    region: list[int] | None = None  # [file, lo, hi, slot_offset, end]

    def flush() -> None:
        nonlocal cur
        if region is not None:
            f, lo, hi, at, end = region
            reads.append(Read(f, lo, at, hi - lo, end - lo))
            cur = at + hi - lo

    for (f, off, nbytes), name in spans:
        lo = off // PAGE * PAGE
        hi = -(-(off + nbytes) // PAGE) * PAGE
        if region is None or region[0] != f or lo > region[2]:
            flush()
            region = [f, lo, hi, cur, off + nbytes]
        else:
            region[2] = max(region[2], hi)
            region[4] = max(region[4], off + nbytes)
        where[name] = region[3] + off - region[1]
    flush()
    entries = []
    payload = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        entries.append(Entry(name, where[name], nbytes, t.dtype, tuple(t.shape)))
        payload += nbytes
    return SlotLayout(tuple(entries), cur, payload, tuple(reads))


class DirectBackend(CpuBackend):
    """Host pool, page-aligned slots, filled by ``os.preadv`` on O_DIRECT descriptors
    (one per file, open for the handle's life). ``preadv`` releases the GIL."""

    io = "direct"

    def __init__(self, device: torch.device, files: Sequence[Path]) -> None:
        super().__init__(device)
        self.files = list(files)
        self.fds: list[int] = []
        try:
            for f in self.files:
                self.fds.append(os.open(f, os.O_RDONLY | O_DIRECT))
        except BaseException:
            self.close()
            raise

    def alloc(self, nbytes: int) -> torch.Tensor:
        raw = torch.empty(nbytes + PAGE, dtype=torch.uint8)
        start = -raw.data_ptr() % PAGE
        return raw[start : start + nbytes]  # the view keeps `raw` alive

    def copy(self, job: Job, throttle: Throttle, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        moved = 0
        mv = memoryview(job.slot.buf.numpy())
        for r in job.layout.reads:
            fd = self.fds[r.file]
            for a in range(0, r.nbytes, CHUNK):
                if stop.is_set():
                    raise Cancelled
                n = min(CHUNK, r.nbytes - a)
                got = os.preadv(
                    fd, [mv[r.slot_offset + a : r.slot_offset + a + n]], r.file_offset + a
                )
                if got < n and a + got < r.needed:
                    raise OSError(
                        f"short read from {self.files[r.file]}: {got} of {n} bytes at offset "
                        f"{r.file_offset + a} (the file is shorter than its header says)"
                    )
                moved += min(n, max(0, r.needed - a))
                throttle.pace(t0, moved, stop)
                if got < n:
                    break

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)
