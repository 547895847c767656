"""The machine's limits, measured in the run and derived from what the CPU says it is.

* ``read_probe()`` / ``read_bandwidth_stats()``: a read-bandwidth probe that streams a
  buffer of at least ``8 x`` the last-level cache (the fastest of ``sum``, ``amax``,
  ``dot`` and topg's GEMV) with every thread the benchmark uses
  (torch's thread count), reported with its spread. The bandwidth of a shared machine
  moves with its load (8-28 GB/s in one hour here), so a row compared with DRAM runs the
  probe in each of its rounds and sets each round's time against that round's bandwidth.
* ``llc_bytes()``: the last-level cache, from ``/sys/devices/system/cpu/cpu0/cache``.
  A working set under ``DRAM_FACTOR x`` the LLC is "in cache" (``classify``); the
  inputs of a row meant to be cold are rotated through ``cold_copies()`` sets.
* ``theoretical_peak()``: fp32 FLOP/s from the ISA, the core count and the clock, with
  the assumptions it rests on spelled out (see ``fp32_flops_per_cycle``).
* ``gemm_stats()``: torch's measured fp32 GEMM rate (1024^3), a machine figure for the
  record; a GEMM row is set against the fastest variant on its shape in the run.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

from torch_topg.bench.timing import Budget, Stats, compare
from torch_topg.modes import cpu_kernels

# A working set of at least this many LLCs is taken as streamed from DRAM: between two
# uses of a byte, three LLCs of other data have passed, whatever the replacement policy.
DRAM_FACTOR = 4
_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", text)
    if not m:
        raise ValueError(f"cache size {text!r}")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2)]


def cache_sizes(root: Path = _CACHE_DIR) -> dict[int, int]:
    """Level -> bytes of the data/unified caches cpu0 sees (empty when not exposed)."""
    out: dict[int, int] = {}
    for index in sorted(root.glob("index*")):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            out[level] = max(out.get(level, 0), _parse_size((index / "size").read_text()))
        except (OSError, ValueError):
            continue
    return out


def llc_bytes(root: Path = _CACHE_DIR) -> tuple[int, str]:
    """The last-level cache's size and where it came from (32 MiB assumed if unknown)."""
    sizes = cache_sizes(root)
    if sizes:
        level = max(sizes)
        return sizes[level], f"L{level} from {root}"
    return 32 << 20, "assumed 32 MiB (sysfs gives no cache sizes)"


def classify(working_set: int, llc: int | None = None) -> str:
    """``"DRAM"`` when ``working_set >= DRAM_FACTOR x LLC``, else ``"in cache"``."""
    llc = llc_bytes()[0] if llc is None else llc
    return "DRAM" if working_set >= DRAM_FACTOR * llc else "in cache"


def cold_copies(working_set: int, llc: int | None = None) -> int:
    """How many input sets to rotate through so that the whole rotation is at least
    ``DRAM_FACTOR x LLC`` (each use then finds its inputs evicted): 1 if one is."""
    llc = llc_bytes()[0] if llc is None else llc
    return max(1, -(-DRAM_FACTOR * llc // max(1, working_set)))


def cpuinfo(path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (empty off Linux)."""
    out: dict[str, str] = {}
    try:
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                if out:
                    break
                continue
            key, _, value = line.partition(":")
            out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def clock_hz(info: dict[str, str] | None = None) -> tuple[float, str]:
    """The core clock: cpufreq's maximum if exposed, else cpuinfo's ``cpu MHz`` (in a VM
    the nominal clock: a boost clock above it makes measured rates exceed the peak)."""
    try:
        khz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
        return khz * 1e3, "cpufreq cpuinfo_max_freq"
    except (OSError, ValueError):
        pass
    info = cpuinfo() if info is None else info
    if "cpu MHz" in info:
        return float(info["cpu MHz"]) * 1e6, "/proc/cpuinfo cpu MHz (nominal; boost not seen)"
    return 0.0, "unknown"


def fp32_flops_per_cycle(info: dict[str, str]) -> tuple[int, str]:
    """fp32 FLOPs per cycle per core of FMA code, and the assumption behind the number.

    Two FMA pipes per core everywhere: AVX2 2 x 8 lanes x 2 = 32; AVX-512 2 x 16 x 2 = 64,
    except AMD family 0x19 (Zen 4), whose 512-bit instructions run on 256-bit pipes: 32.
    """
    flags = set(info.get("flags", "").split())
    vendor = info.get("vendor_id", "")
    family = int(info.get("cpu family", "0") or 0)
    if "avx512f" in flags:
        if vendor == "AuthenticAMD" and family == 0x19:
            return 32, "Zen 4: AVX-512 on 2 x 256-bit FMA pipes, 2 x 8 x 2"
        return 64, "AVX-512: 2 x 512-bit FMA pipes assumed, 2 x 16 x 2"
    if "avx2" in flags and "fma" in flags:
        return 32, "AVX2 + FMA: 2 x 256-bit FMA pipes assumed, 2 x 8 x 2"
    if "avx" in flags:
        return 16, "AVX without FMA: one 8-wide add and one 8-wide multiply"
    return 8, "SSE: one 4-wide add and one 4-wide multiply (or unknown ISA)"


def theoretical_peak(
    threads: int | None = None,
    info: dict[str, str] | None = None,
    measured_flops: float | None = None,
) -> dict:
    """fp32 FMA peak FLOP/s of ``threads`` cores (torch's thread count by default).

    Where the clock is only cpuinfo's nominal one (a VM without cpufreq), a measured fp32
    rate above the peak at that clock proves the cores boost above it: the clock is then
    the one that rate implies (``measured_flops``, e.g. torch's GEMM at the top of its
    spread), and the assumptions say so. A peak that a measurement exceeds is no limit.
    """
    info = cpuinfo() if info is None else info
    threads = threads or torch.get_num_threads()
    per_cycle, isa = fp32_flops_per_cycle(info)
    hz, clock_source = clock_hz(info)
    if (
        measured_flops
        and not clock_source.startswith("cpufreq")
        and per_cycle * threads * hz < measured_flops
    ):
        implied = measured_flops / (per_cycle * threads)
        clock_source = (
            f"{implied / 1e9:.2f} GHz, implied by the fastest fp32 GEMM measured (cpuinfo's "
            f"{hz / 1e9:.2f} GHz is nominal; the boost clock is not exposed here)"
        )
        hz = implied
    return {
        "fp32_flops": per_cycle * threads * hz,
        "flops_per_cycle_per_core": per_cycle,
        "cores": threads,
        "clock_hz": hz,
        "assumptions": f"{isa}; clock: {clock_source}; one core per thread",
    }


@functools.cache
def _probe_buffer(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4, dtype=torch.float32)


@functools.cache
def _probe_kernel(nbytes: int, threads: int) -> tuple[str, Callable[[], object]]:
    """The fastest of a few streaming readers of the buffer, chosen once per process and
    thread count: torch's ``sum`` alone is partly compute-bound on one core (its cascade
    summation), ~15% below ``amax`` or ``dot`` there; topg's GEMV where it is built."""
    buf = _probe_buffer(nbytes)
    kernels: dict[str, Callable[[], object]] = {
        "sum": buf.sum,
        "amax": buf.amax,
        "dot": lambda: torch.dot(buf, buf),
    }
    # topg's GEMV streams the buffer as a [N, 1024] weight: on this machine it reads
    # faster than torch's reductions (runs with only those put fp32 M=1 linears at up to
    # 110% of the "limit" in every round). The limit is the best any reader reaches.
    if torch._C._dispatch_has_kernel_for_dispatch_key("topg::linear", "CPU"):
        w, x = buf.view(-1, 1024), torch.ones(1, 1024)
        kernels["topg gemv"] = lambda: torch.ops.topg.linear(x, w)
    cmp = compare(kernels, Budget(warmup=1, min_rounds=3, max_rounds=3, min_sample_s=0.0))
    name = min(kernels, key=lambda k: cmp.stats(k).median)
    _PROBE_NAMES[nbytes, threads] = name
    return name, kernels[name]


_PROBE_NAMES: dict[tuple[int, int], str] = {}  # outlives release_probe()


def _probe_bytes(factor: int) -> int:
    return max(factor * llc_bytes()[0], 256 << 20)


def release_probe() -> None:
    """Free the probe's buffer (``factor x LLC``: 3.75 GiB where a VM reports a 480 MiB
    L3), keeping what it measured: a benchmark of large models calls this once the
    bandwidth is known, so the buffer neither takes their memory nor counts in their
    peak RSS. A later probe allocates it again."""
    _probe_kernel.cache_clear()
    _probe_buffer.cache_clear()


def read_probe(factor: int = 8) -> tuple[Callable[[], object], int]:
    """The read-bandwidth probe as a callable and the bytes one call reads: the fastest
    of ``sum``, ``amax``, ``dot(x, x)`` and topg's GEMV over an fp32 buffer of ``factor x LLC`` (at
    least 256 MiB), kept for the process. A benchmark interleaves it with a row's
    variants to measure the bandwidth in the same rounds as the row."""
    nbytes = _probe_bytes(factor)
    return _probe_kernel(nbytes, torch.get_num_threads())[1], nbytes


def read_probe_name(factor: int = 8) -> str:
    nbytes = _probe_bytes(factor)
    name = _PROBE_NAMES.get((nbytes, torch.get_num_threads()))
    return name if name is not None else _probe_kernel(nbytes, torch.get_num_threads())[0]


@functools.cache
def read_bandwidth_stats(threads: int | None = None) -> Stats:
    """Read bandwidth in bytes/s: ``read_probe()`` with ``threads`` threads (torch's
    count by default), 10 rounds."""
    probe, nbytes = read_probe()
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        budget = Budget(warmup=2, min_rounds=10, max_rounds=10, min_sample_s=0.0)
        return compare({"sum": probe}, budget).stats("sum").inverse(float(nbytes))
    finally:
        torch.set_num_threads(old)


def read_bandwidth() -> float:
    """The probe's median, bytes/s."""
    return read_bandwidth_stats().median


@functools.cache
def gemm_stats(n: int = 1024, dtype: torch.dtype = torch.float32) -> Stats:
    """torch's ``n x n x n`` GEMM rate in FLOP/s (median and spread over rounds)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    cmp = compare({"mm": lambda: torch.mm(a, b)}, Budget(min_rounds=10, budget_s=1.0))
    return cmp.stats("mm").inverse(2.0 * n**3)


def gemm_rate(n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    return gemm_stats(n, dtype).median


def remeasure() -> None:
    """Forget the probes' results: the next call measures again (a new run)."""
    read_bandwidth_stats.cache_clear()
    gemm_stats.cache_clear()
    _probe_kernel.cache_clear()
    _PROBE_NAMES.clear()


def _compiler() -> str:
    try:
        out = subprocess.run(["c++", "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _torch_compiler() -> str:
    m = re.search(r"^\s*- (GCC|Clang|MSVC)[^\n]*", torch.__config__.show(), re.M)
    return m.group(0).strip(" -") if m else "unknown"


def machine_info(measure: bool = True) -> dict:
    """What the record says about the machine; ``measure`` runs the probes (seconds)."""
    info = cpuinfo()
    llc, llc_source = llc_bytes()
    build = Path(__file__).resolve().parent.parent / "_build_info.json"
    topg_build = json.loads(build.read_text()) if build.exists() else {}
    out = {
        "cpu_model": info.get("model name", platform.processor() or platform.machine()),
        "vendor": info.get("vendor_id", ""),
        "cpu_family": info.get("cpu family", ""),
        "logical_cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "caches": {f"L{k}": v for k, v in cache_sizes().items()},
        "llc_bytes": llc,
        "llc_source": llc_source,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "peak": theoretical_peak(info=info, measured_flops=gemm_stats().hi if measure else None),
        "torch": torch.__version__,
        "torch_compiler": _torch_compiler(),
        "compiler": _compiler(),
        "topg_build": topg_build,
        "topg_cpu_kernels": cpu_kernels(),
        "python": platform.python_version(),
        "load_avg_1min": load_average(),
        "cpu_busy_1s": cpu_busy() if measure else None,
    }
    if measure:
        out["read_bw"] = read_bandwidth_stats().to_dict()
        out["read_bw_buffer_bytes"] = _probe_bytes(8)
        out["read_bw_kernel"] = read_probe_name()
        out["gemm_fp32_1024"] = gemm_stats().to_dict()
    return out


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): above ~half the CPUs,
    other processes take cores from a multi-threaded call and its figures."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def cpu_busy(window_s: float = 1.0) -> float | None:
    """The fraction of CPU time the other processes used over the last ``window_s``
    seconds, from /proc/stat (None where it is not readable). Unlike the load average it
    does not trail: a run that starts right after the previous one is not called busy
    because of its own predecessor."""

    def sample() -> tuple[int, int]:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        ticks = [int(x) for x in fields]
        idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
        return sum(ticks), idle

    try:
        total0, idle0 = sample()
        time.sleep(window_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    total = total1 - total0
    return 1.0 - (idle1 - idle0) / total if total > 0 else None


def describe(m: dict) -> str:
    """One paragraph for the top of a table."""
    peak = m["peak"]
    text = (
        f"{m['cpu_model']}, {m['threads']} threads of {m['logical_cpus']} CPUs, "
        f"LLC {m['llc_bytes'] >> 20} MiB, torch {m['torch']} ({m['torch_cpu_capability']}), "
        f"topg kernels built for {m.get('topg_build', {}).get('cpu_isa', '?')}, "
        f"compiler {m['compiler']}. "
        f"fp32 peak {peak['fp32_flops'] / 1e9:.0f} GFLOP/s ({peak['assumptions']})"
    )
    if "read_bw" in m:
        bw = Stats.from_dict(m["read_bw"]).scaled(1e-9)
        gemm = Stats.from_dict(m["gemm_fp32_1024"]).scaled(1e-9)
        text += (
            f"; measured read bandwidth {bw.fmt('.1f')} GB/s ({bw.spread}, "
            f"{m.get('read_bw_kernel', 'sum')} over "
            f"{m.get('read_bw_buffer_bytes', 0) >> 20} MiB by {m['threads']} "
            f"threads), torch fp32 GEMM 1024^3 {gemm.fmt('.0f')} GFLOP/s"
        )
    load, used = m.get("load_avg_1min"), m.get("cpu_busy_1s")
    if used is not None:  # what other processes used just before the run (no trailing)
        busy = used > 0.25
        text += f"; CPUs {used:.0%} busy in the second before the run"
        text += f" (1-min load average {load:.2f})" if load is not None else ""
        text += " (BUSY machine)" if busy else ""
    elif load is not None:
        busy = load > 0.5 * (m.get("logical_cpus") or 1)
        text += f"; 1-min load average at the start {load:.2f}{' (BUSY machine)' if busy else ''}"
    return text + "."
