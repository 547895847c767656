"""Batch-1 decode at the sizes people run, side by side with llama.cpp on the same GGUF
files: models of real architectures' shapes with random weights (torch_topg/bench/
real_size.py), written once as a BF16 GGUF by llama.cpp's converter, then quantised by
llama-quantize to each format.

    python python/benchmarks/real_size.py --shape llama-3.2-1b \\
        --formats bf16,q8_0,q4_0,q4_k_m,q5_k_m,q6_k --repeats 3
    python python/benchmarks/real_size.py --table            # combine the records

Staged and resumable: a shape's BF16 GGUF is kept in the cache (the only unquantised
copy; the safetensors it came from are deleted once it is written, unless --keep); each
format is quantised, measured and written as its own record (bench_results/
real_size-<date>-<commit>.json, one row per format), and its file deleted unless --keep.
--table combines the newest row per (shape, format) among records of the newest commit
measured on this machine type.

Per format, ``repeats`` interleaved rounds of: llama-bench (``-p 0 -n 64 -d 256 -t 2``,
flash attention off and on, the faster kept), the engine with int8 activations, and the
engine with fp32 activations (``quantization={"method": "gguf", ...}``; BF16: the file in
bf16; ``--activations`` picks the forms), each round in a rotated order. Sides that do not
fit in memory together (8B: each holds the file's bytes) take turns instead: one loaded,
its rounds, closed (the record's ``order`` says which). Each row also records this
process's peak RSS during the format (the engines; real_size_serve.py compares the peak
with llama-server's). Reported with each side's share of the read limit:
the bytes a decode step reads (every tensor of the file once, the embedding table once
if it is also the LM head, else one row of it, an MoE layer's experts in the share a
token uses, ``expert_used_count / expert_count``; plus the KV cache at the context) over
the read bandwidth measured in the same run. The weights' values do not change the
speed: every kernel reads all of a weight whatever it holds.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from engine_common import DECODE_CONTEXT, DECODE_TOKENS, THREADS
from quantized_llama import EngineSide

from torch_topg.bench.machine import machine_info, read_bandwidth_stats, release_probe
from torch_topg.bench.memory import check_disk_room, peak_rss_mb, reset_peak_rss, sides_fit
from torch_topg.bench.record import load_record, new_record, write_record
from torch_topg.bench.timing import summarize

FORMATS = {"bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M",
           "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}  # fmt: skip
# Bits a weight of each format (what its file's size is over the BF16 file's, about).
BITS = {"bf16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "q4_k_m": 4.9, "q5_k_m": 5.7, "q6_k": 6.6}


def cache_root() -> Path:
    root = os.environ.get("TOPG_CACHE_DIR", str(Path.home() / ".cache" / "torch_topg"))
    return Path(root) / "real-size"


def bf16_file(shape: str, llama_src: Path, keep: bool) -> Path:
    """The shape's BF16 GGUF, written once (checkpoint, then llama.cpp's converter)."""
    from torch_topg.bench.real_size import convert_to_gguf, write_checkpoint
    from torch_topg.models.hf import smollm2_folder

    out = cache_root() / f"{shape}-bf16.gguf"
    if out.exists():
        return out
    from torch_topg.bench.real_size import _parameter_shapes, config_for

    folder = cache_root() / shape
    params = sum(torch.Size(s).numel() for s in _parameter_shapes(config_for(shape)).values())
    check_disk_room(out, 2 * 2 * params)  # the checkpoint and the GGUF, bf16 each
    print(f"[{shape}] writing the checkpoint to {folder}", flush=True)
    write_checkpoint(shape, folder, smollm2_folder())
    print(f"[{shape}] converting to {out.name}", flush=True)
    convert_to_gguf(folder, out, llama_src / "convert_hf_to_gguf.py")
    if not keep:
        shutil.rmtree(folder)
    return out


def quantized_file(shape: str, fmt: str, bf16: Path, quantize: Path) -> Path:
    if fmt == "bf16":
        return bf16
    out = cache_root() / f"{shape}-{fmt}.gguf"
    if not out.exists():
        check_disk_room(out, int(bf16.stat().st_size * BITS[fmt] / 16))
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        cmd = [str(quantize), str(bf16), str(tmp), FORMATS[fmt], str(THREADS)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not tmp.exists():
            raise RuntimeError(f"llama-quantize exited {p.returncode}: {p.stderr[-500:]}")
        tmp.rename(out)
    return out


def format_files(
    shape: str, formats: str, keep: bool
) -> Iterator[tuple[str, Path, dict[str, str]]]:
    """``(format, its GGUF file, llama.cpp's binaries)`` per format of the comma-separated
    ``formats``: llama.cpp built once, the shape's BF16 GGUF written once, each quantised
    file made before its turn and deleted after it unless ``keep``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from llama_cpp_build import ensure_llama_cpp, llama_cpp_sources

    llama = {k: str(v) for k, v in ensure_llama_cpp().items()}
    bf16 = bf16_file(shape, llama_cpp_sources(), keep)
    for fmt in formats.split(","):
        path = quantized_file(shape, fmt, bf16, Path(llama["llama-quantize"]))
        try:
            yield fmt, path, llama
        finally:
            if fmt != "bf16" and not keep:
                path.unlink(missing_ok=True)


@functools.cache
def machine() -> dict:
    """The records' machine, measured once a process, before any model loads; the read
    probe's buffer (``8 x LLC``, 3.75 GiB on a VM that reports a 480 MiB L3) is freed
    afterwards, so it neither takes the models' memory nor counts in their peak RSS."""
    info = machine_info()
    release_probe()
    return info


def save_rows(benchmark: str, rows: list[dict], notes: list[str], out: str) -> None:
    """One record of ``rows`` (this machine, this commit), its path printed."""
    notes = [*notes, "random weights: speed does not depend on the weights' values"]
    rec = new_record(benchmark, rows, machine(), notes=notes)
    print(f"record {write_record(rec, out)}", flush=True)


def read_bytes(path: Path, context: int) -> tuple[int, dict[str, int]]:
    """Bytes one decode step reads from the file's tensors at ``context`` tokens (see the
    module docstring), and the tensor count per storage type."""
    import gguf

    r = gguf.GGUFReader(path)
    kinds: dict[str, int] = {}
    sizes = {}
    for t in r.tensors:
        kinds[t.tensor_type.name.lower()] = kinds.get(t.tensor_type.name.lower(), 0) + 1
        sizes[t.name] = int(t.n_bytes)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def field(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].parts[-1][0])

    total = sum(sizes.values())
    if "output.weight" in sizes:  # untied: the lookup reads one row of the embedding
        emb = next(t for t in r.tensors if t.name == "token_embd.weight")
        total -= sizes["token_embd.weight"] - sizes["token_embd.weight"] // int(emb.shape[-1])
    if f"{arch}.expert_count" in r.fields:  # MoE: one token reads its experts only
        experts = sum(n for name, n in sizes.items() if "_exps." in name)
        used, count = field("expert_used_count"), field("expert_count")
        total -= experts - experts * used // count
    layers, kv_heads = field("block_count"), field("attention.head_count_kv")
    head_dim = field("embedding_length") // field("attention.head_count")
    if f"{arch}.attention.key_length" in r.fields:
        head_dim = field("attention.key_length")
    kv = 2 * layers * kv_heads * head_dim * context * 2  # bf16 / f16 caches on both sides
    return total + kv, kinds


class LlamaBench:
    """llama-bench decode samples, flash attention off and on (each call warms up)."""

    def __init__(self, bench: Path, path: Path) -> None:
        self.bench, self.path = bench, path
        self.samples: dict[int, list[float]] = {0: [], 1: []}
        self.cmd = ""
        self.build = ""

    def round(self) -> None:
        cmd = [str(self.bench), "-m", str(self.path), "-t", str(THREADS), "-r", "1", "-o",
               "json", "-p", "0", "-n", str(DECODE_TOKENS), "-d", str(DECODE_CONTEXT),
               "-fa", "0,1"]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-400:]}")
        for row in json.loads(p.stdout):
            fa = int(bool(row.get("flash_attn")))
            self.samples[fa] += [x / 1e6 / DECODE_TOKENS for x in row["samples_ns"]]
            self.build = f"{row.get('build_commit')} ({row.get('build_number')})"
        self.cmd = " ".join(cmd)

    def close(self) -> dict:
        per = {fa: summarize(s) for fa, s in self.samples.items() if s}
        best = min(per, key=lambda fa: per[fa].median)
        return {"decode_ms": per[best], "flash_attn": best, "cmd": self.cmd, "build": self.build,
                "by_flash_attn": {str(k): v.to_dict() for k, v in per.items()}}  # fmt: skip


def run_format(
    shape: str, fmt: str, path: Path, llama: dict, repeats: int, bw: float, acts: list[str]
) -> dict:
    nbytes, kinds = read_bytes(path, DECODE_CONTEXT)
    limit_ms = nbytes / bw * 1e3
    reset_peak_rss()  # this format's peak: the engines load here, llama-bench is a child
    makers: dict = {"llama.cpp": lambda: LlamaBench(llama["llama-bench"], path)}
    if fmt == "bf16":
        makers["topg"] = lambda: EngineSide(path, False, quantization=None, dtype="bfloat16",
                                            ttft=False)  # fmt: skip
    else:
        for act in acts:
            makers[f"topg {act} act."] = lambda i8=act == "int8": EngineSide(path, i8, ttft=False)
    names = list(makers)
    # Every side holds the file's bytes (the engine its weights, llama-bench the page
    # cache of the file it maps); at 8B they do not all fit, and then take turns.
    together = sides_fit([path.stat().st_size] * len(names))
    if together:
        sides = {name: make() for name, make in makers.items()}
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                sides[name].round()
        closed = {name: side.close() for name, side in sides.items()}
    else:
        print(f"[{shape} {fmt}] the sides do not fit in memory together: one at a time",
              flush=True)  # fmt: skip
        closed = {}
        for name, make in makers.items():
            side = make()
            for _ in range(repeats):
                side.round()
            closed[name] = side.close()
            del side
            forget_engines()
    figures, extra = {}, {}
    for name, out in closed.items():
        figures[name] = out["decode_ms"]
        extra[name] = {k: v for k, v in out.items() if k not in ("decode_ms", "prefill_ms")}
    lc = figures["llama.cpp"].median
    row = {
        "key": f"{shape} | {fmt} | batch-1 decode",
        "shape": shape,
        "format": fmt,
        "unit": "ms/token",
        "figures": {k: v.to_dict() for k, v in figures.items()},
        "ratios": {
            f"{k} / llama.cpp": v.scaled(1 / lc).to_dict()
            for k, v in figures.items()
            if k != "llama.cpp"
        },
        "order": "interleaved rounds" if together else "one side at a time (memory)",
        "read_limit_ms": limit_ms,
        "read_bytes": nbytes,
        "read_bandwidth": bw,
        "read_share": {k: limit_ms / v.median for k, v in figures.items()},
        "tensors": kinds,
        "file_bytes": path.stat().st_size,
        "topg_peak_rss_gib": (peak_rss_mb() or 0.0) / 1024,
        "sides": json.loads(json.dumps(extra, default=lambda o: o.to_dict())),
    }
    line = ", ".join(f"{k} {v.fmt()} ms ({limit_ms / v.median:.0%} of the read limit)"
                     for k, v in figures.items())  # fmt: skip
    print(f"[{shape} {fmt}] {line}; topg peak RSS {row['topg_peak_rss_gib']:.2f} GiB", flush=True)
    if together:  # (taking turns, each side was released after its rounds)
        del sides
        forget_engines()
    return row


def forget_engines() -> None:
    """Release closed engines before the next side or format loads: a run of five 1B
    formats then BF16 in one process was killed at 24 GiB at the BF16 load (earlier
    formats' models still held; dynamo's caches keep the modules they traced)."""
    torch._dynamo.reset()
    gc.collect()


def table(out: Path) -> str:
    """Markdown of the newest row per (shape, format) among the records of the newest
    commit measured on this machine type."""
    recs = []
    for p in sorted(out.glob("real_size-*.json")):
        try:
            recs.append(load_record(p))
        except ValueError:
            continue
    if not recs:
        return "no real_size records"
    model = machine_info(measure=False).get("cpu_model", "")
    recs = [r for r in recs if r["machine"].get("cpu_model", "") == model] or recs
    commit = max(recs, key=lambda r: r["date"])["commit"]
    rows: dict = {}
    for r in sorted((r for r in recs if r["commit"] == commit), key=lambda r: r["date"]):
        for row in r["rows"]:
            rows[(row["shape"], row["format"])] = (row, r)
    lines = [f"Commit {commit}, {model or 'this machine'}; 2 threads each; random weights "
             "(speed does not depend on the weights' values).", "",
             "| shape | format | topg ms/token | share of read limit | llama.cpp ms/token | "
             "share | topg / llama.cpp |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for (shape, fmt), (row, _) in sorted(rows.items()):
        fig = row["figures"]
        name = min((k for k in fig if k != "llama.cpp"), key=lambda k: fig[k]["median"])
        t, lc = fig[name], fig["llama.cpp"]
        share = row["read_share"]
        lines.append(f"| {shape} | {fmt} ({name}) | {t['median']:.1f} [{t['lo']:.1f}-{t['hi']:.1f}] | "
                     f"{share[name]:.0%} | {lc['median']:.1f} [{lc['lo']:.1f}-{lc['hi']:.1f}] | "
                     f"{share['llama.cpp']:.0%} | {t['median'] / lc['median']:.2f}x |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and quantised files")
    ap.add_argument("--table", action="store_true", help="print the combined table and exit")
    ap.add_argument(
        "--activations",
        default="int8,fp32",
        help="the engine's activation forms on the quantised files (int8, fp32)",
    )
    ap.add_argument("--out", default="bench_results")
    a = ap.parse_args(argv)
    acts = a.activations.split(",")
    if not set(acts) <= {"int8", "fp32"} or not acts:
        ap.error(f"--activations: expected int8 and / or fp32, got {a.activations!r}")
    if a.table:
        print(table(Path(a.out)))
        return 0
    bw = read_bandwidth_stats(THREADS)
    machine()  # measured now, its probe buffer freed before the first model loads
    print(f"read bandwidth {bw.scaled(1e-9).fmt('.1f')} GB/s", flush=True)
    for fmt, path, llama in format_files(a.shape, a.formats, a.keep):
        row = run_format(a.shape, fmt, path, llama, a.repeats, bw.median, acts)
        save_rows("real_size", [row], [f"read bandwidth {bw.scaled(1e-9).fmt('.1f')} GB/s "
                                       f"({THREADS} threads)"], a.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
