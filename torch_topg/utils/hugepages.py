"""Host tensors in transparent huge pages (2 MiB) for the engine's CPU weights and KV cache.

A CPU decode step streams every weight and the KV it attends over once per step, 4 KiB
page after 4 KiB page: with 4 KiB pages that is a TLB miss and a page walk every 64 cache
lines. Linux backs memory with 2 MiB pages where a mapping asks for them
(``madvise(MADV_HUGEPAGE)``; ``/sys/kernel/mm/transparent_hugepage/enabled`` set to
``madvise`` or ``always``), which torch's allocator does only when
``THP_MEM_ALLOC_ENABLE=1`` is set before torch starts. Measured in one process on a
2-core Zen 3 (the decode plan's SmolLM2 step over huge pages against 4 KiB-page copies,
``python/benchmarks/hugepages.py``, docs/decode-step.md "weights and KV cache in huge
pages"): fp32 0.88-0.99x the time, bf16 0.96-1.02x; outputs bitwise equal.

Memory comes from a private anonymous mapping (``mmap``), advised before it is touched,
so pages are still committed on first write (a KV pool's unused blocks cost nothing).
``TOPG_HUGEPAGES=0`` turns this off (plain ``torch.empty``); it is off where the platform
has no ``MADV_HUGEPAGE``.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import weakref
from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = [
    "HUGE_PAGE",
    "empty",
    "enabled",
    "file_mapped_bytes",
    "in_huge_pages",
    "is_advised",
    "rehome_",
    "release_file_pages",
]

#: Bytes of one huge page (x86-64 and aarch64 with 4 KiB base pages); smaller tensors stay
#: on torch's allocator.
HUGE_PAGE = 2 << 20


@functools.cache
def _advice_accepted() -> bool:
    """Whether the kernel accepts ``MADV_HUGEPAGE`` (not where THP is compiled out)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    mm = mmap.mmap(-1, HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
        return True
    except OSError:
        return False
    finally:
        mm.close()


def enabled() -> bool:
    """Whether :func:`empty` advises huge pages here (Linux accepting ``MADV_HUGEPAGE``,
    and ``TOPG_HUGEPAGES`` not ``0``)."""
    return os.environ.get("TOPG_HUGEPAGES", "1") != "0" and _advice_accepted()


def empty(shape: tuple[int, ...] | list[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor; from :data:`HUGE_PAGE` bytes on (and where
    :func:`enabled`), in memory advised for transparent huge pages. The tensor keeps its
    mapping alive; the mapping is unmapped when the last view of it is freed."""
    shape = tuple(int(s) for s in shape)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes < HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    # MAP_PRIVATE: a shared anonymous mapping is shmem, which follows the separate
    # shmem_enabled setting (usually never)
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape)
    lo = t.data_ptr()
    _MAPPED[lo] = lo + nbytes
    weakref.finalize(mm, _MAPPED.pop, lo, None)  # unmapped with the last view of it
    return t


#: start -> end of each live mapping :func:`empty` made.
_MAPPED: dict[int, int] = {}


def _within(t: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    """Whether all of ``t``'s bytes lie in one of ``ranges`` (``(start, end)`` addresses)."""
    lo = t.data_ptr()
    hi = lo + t.numel() * t.element_size()
    return any(a <= lo and hi <= b for a, b in ranges)


def in_huge_pages(t: torch.Tensor) -> bool:
    """Whether ``t``'s bytes lie in memory :func:`empty` advised for huge pages (a tensor
    built there needs no :func:`rehome_`)."""
    return _within(t, list(_MAPPED.items()))


def release_file_pages(*tensors: torch.Tensor) -> None:
    """Drop the resident pages of each tensor lying in a read-only file mapping (a GGUF
    file's tensor), for a loader that has copied it: else the mapped bytes it read stay
    resident beside the copy. Views still reading them fault them in again (same bytes)."""
    maps = _read_only_file_maps()
    for t in tensors:
        _release_file_pages(t, maps)


def _read_only_file_maps() -> list[tuple[int, int]]:
    """``(start, end)`` of this process' read-only file mappings (``/proc/self/maps``:
    no ``w`` permission, a device and inode); empty where there is no such file."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 6 or "w" in parts[1] or parts[4] == "0":
                    continue
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                out.append((lo, hi))
    except OSError:
        return []
    return out


@functools.cache
def _madvise() -> object | None:
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _release_file_pages(t: torch.Tensor, maps: list[tuple[int, int]]) -> None:
    """Drop the resident pages of ``t``'s bytes from this process when they lie in a
    read-only file mapping (``MADV_DONTNEED``: a later read faults them in from the file
    again, so any view still reading them sees the same bytes). A GGUF file's tensors
    are mapped; once copied into huge pages the mapped copy would otherwise stay
    resident, and the peak RSS of a load would be twice the weights."""
    fn = _madvise()
    if fn is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if not _within(t, maps):
        return
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    page = mmap.PAGESIZE
    start, end = -(-lo // page) * page, hi // page * page
    if end > start:
        fn(start, end - start, mmap.MADV_DONTNEED)


def file_mapped_bytes(module: torch.nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that :func:`rehome_` would copy out of
    read-only file mappings (a GGUF file's tensors): memory the copy will take, which the
    system counts as available (page cache) until then. 0 where not :func:`enabled`."""
    if not enabled():
        return 0
    maps = _read_only_file_maps()
    seen: set[int] = set()
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or nbytes < HUGE_PAGE or t.data_ptr() in seen:
            continue
        if _within(t, maps):
            seen.add(t.data_ptr())
            total += nbytes
    return total


#: Bytes of a read-only file mapping :func:`rehome_` copies before releasing their pages.
RELEASE_CHUNK = 64 << 20


def rehome_(module: torch.nn.Module, lock: AbstractContextManager[Any] | None = None) -> int:
    """Moves ``module``'s contiguous CPU parameters and buffers of :data:`HUGE_PAGE` bytes or
    more into :func:`empty` memory, in place (``.data`` swapped, values unchanged; tensors
    sharing memory, as a tied embedding and LM head, stay shared and are swapped
    together); those already there (built in :func:`empty` memory) stay. Returns the bytes
    moved; 0 where not :func:`enabled`.

    ``lock``: held around each swap, for a model that runs steps meanwhile on another
    thread (the engine's background warm-up). A source in a read-only file mapping (a GGUF
    file's tensor) is copied :data:`RELEASE_CHUNK` bytes at a time, each chunk's pages
    released once copied, all of it holding ``lock``: no step can fault the released
    pages in again before the swap, so the peak RSS is the weights once plus one chunk,
    not plus the tensor (a step that ran before had all of the file resident). Other
    sources are copied outside the lock."""
    if not enabled():
        return 0
    lock = lock if lock is not None else contextlib.nullcontext()
    shared: dict[int, list[torch.Tensor]] = {}  # by the memory they start at
    for t in [*module.parameters(), *module.buffers()]:
        nbytes = t.numel() * t.element_size()
        if t.device.type != "cpu" or t.is_sparse or nbytes < HUGE_PAGE:
            continue
        if t.is_contiguous() and t.storage_offset() == 0 and not in_huge_pages(t):
            shared.setdefault(t.data_ptr(), []).append(t)
    maps = _read_only_file_maps()
    total = 0
    with torch.no_grad():
        for ts in shared.values():
            first = ts[0]
            nbytes = first.numel() * first.element_size()
            total += nbytes
            if _within(first, maps):
                with lock:
                    new = _copy_releasing(first, maps)
                    _swap(ts, new)
            else:
                new = empty(first.shape, first.dtype).copy_(first)
                with lock:
                    _swap(ts, new)
    return total


def _swap(ts: list[torch.Tensor], new: torch.Tensor) -> None:
    """``.data`` of each of ``ts`` (one memory) to ``new``, or to a copy of its own where
    its shape or dtype differs from ``new``'s."""
    for t in ts:
        t.data = (
            new
            if (t.shape, t.dtype) == (new.shape, new.dtype)
            else empty(t.shape, t.dtype).copy_(t)
        )


def _copy_releasing(src: torch.Tensor, maps: list[tuple[int, int]]) -> torch.Tensor:
    """An :func:`empty` copy of ``src`` (in a read-only file mapping), each
    :data:`RELEASE_CHUNK` of its pages released as soon as it is copied."""
    new = empty(src.shape, src.dtype)
    flat_src, flat_new = src.view(-1), new.view(-1)
    step = max(1, RELEASE_CHUNK // src.element_size())
    for a in range(0, flat_src.numel(), step):
        part = flat_src[a : a + step]
        flat_new[a : a + step].copy_(part)
        _release_file_pages(part, maps)
    _release_file_pages(src, maps)  # the pages straddling two chunks
    return new


def is_advised(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a mapping advised for huge pages (``hg`` in its
    ``/proc/self/smaps`` VmFlags). False where there is no such file."""
    try:
        with open("/proc/self/smaps") as f:
            text = f.read()
    except OSError:
        return False
    addr, inside = t.data_ptr(), False
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return "hg" in line.split()[1:]
    return False
