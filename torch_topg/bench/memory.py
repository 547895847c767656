"""A process's memory, as the benchmarks report it (Linux ``/proc``; ``None`` elsewhere).

* ``rss_mb(pid)`` / ``peak_rss_mb(pid)``: the resident set now (VmRSS) and its peak
  (VmHWM), in MB (2^20 bytes), of this process or another (a server under test).
* ``reset_peak_rss()``: the peak restarts from the current resident set, so the peak
  read afterwards is that of the run, not of loading (which converts weights).
* ``resident_mb(tensors)``: how much of some tensors' memory is resident (``mincore``):
  a KV pool made with ``torch.empty`` is committed only as its blocks are written.
* ``sides_fit(bytes)``: whether benchmark sides of those sizes fit in memory at once.
* ``check_disk_room(path, bytes)``: refuses a benchmark file that would leave the disk
  with less than a reserve free (the test suite's own environments need room too).
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
from collections.abc import Iterable
from pathlib import Path

import torch


def _status_mb(field: str, pid: int | str = "self") -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb(pid: int | str = "self") -> float | None:
    """The resident set (VmRSS) of ``pid``, MB."""
    return _status_mb("VmRSS", pid)


def peak_rss_mb(pid: int | str = "self") -> float | None:
    """The peak resident set (VmHWM) of ``pid``, MB; for this process without
    ``/proc``, ``getrusage``'s maximum."""
    peak = _status_mb("VmHWM", pid)
    if peak is None and pid == "self":
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return peak


def reset_peak_rss() -> None:
    """Linux: restart this process's peak (VmHWM) from its current resident set."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def resident_mb(tensors: Iterable[torch.Tensor]) -> float | None:
    """MB of ``tensors``' memory that is resident (``mincore``), pages counted once per
    tensor; ``None`` where ``mincore`` is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for t in tensors:
            start = t.data_ptr() // page * page
            end = t.data_ptr() + t.numel() * t.element_size()
            n = -(-(end - start) // page)
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
                return None
            total += sum(v & 1 for v in vec) * page
        return total / 2**20
    except (OSError, AttributeError):
        return None


def total_memory_bytes() -> int | None:
    """The machine's memory (``MemTotal``), bytes; ``None`` without ``/proc``."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def sides_fit(resident_bytes: Iterable[int], share: float = 0.75) -> bool:
    """Whether benchmark sides holding ``resident_bytes`` each (a model's weights: its
    engine's copy, or the page cache of a file a peer maps) fit in ``share`` of the
    machine's memory at once. When they do not, the sides take turns (one loaded, its
    rounds, closed): kept side by side, the page cache of one would evict the other's
    weights and time the disk."""
    total = total_memory_bytes()
    return total is None or sum(resident_bytes) <= share * total


#: Disk left free below the benchmarks' files by default, GiB: ``make test`` and CI's CUDA /
#: vLLM lanes install about 15 GB of environments (torch's CUDA build among them) beside
#: them. ``TOPG_BENCH_DISK_RESERVE_GIB`` overrides it.
DISK_RESERVE_GIB = 25.0


def check_disk_room(path: str | os.PathLike[str], need_bytes: int) -> None:
    """Raise ``OSError`` naming ``path``, the bytes needed, those free and the reserve,
    when writing ``need_bytes`` more under ``path`` would leave less than the reserve
    free (``TOPG_BENCH_DISK_RESERVE_GIB``, default ``DISK_RESERVE_GIB``). The real-size
    files reach tens of GB at 8B and stay cached: a full disk once failed the next
    environment install."""
    reserve = float(os.environ.get("TOPG_BENCH_DISK_RESERVE_GIB", DISK_RESERVE_GIB)) * 2**30
    d = Path(path)
    while not d.exists() and d != d.parent:
        d = d.parent
    free = shutil.disk_usage(d).free
    if free - need_bytes < reserve:
        gib = 2**30
        raise OSError(
            f"not enough disk for {path}: needs ~{need_bytes / gib:.1f} GiB, {free / gib:.1f} GiB "
            f"free, and {reserve / gib:.0f} GiB are kept free (TOPG_BENCH_DISK_RESERVE_GIB); "
            "delete cached files (`make bench-clean`) or point TOPG_CACHE_DIR elsewhere"
        )
