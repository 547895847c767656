"""Whole-model benchmark: eager vs Inductor vs topg (and llama.cpp for SmolLM2).

Per model (SmolLM2-135M with its real weights, a ~150M Llama, a ~360M Mixtral with 8
experts top-2) and dtype (fp32, bf16), each mode runs in its own process (clean compile
caches and peak-memory figures):

* decode: median ms of one decode step, batch 1, after a 256-token prompt (context 256),
  transformers ``DynamicCache``;
* prefill: ms of a 256-token prompt;
* compile: seconds from the first call to a warm decode step (prefill + decode graphs);
* memory: peak RSS of the process from after loading to the end of the run (compiling
  included) and the model's resident weight bytes;
* limit: the decode step's physical floor, (weight bytes + KV bytes read per step) over
  the read bandwidth measured in this run.

    python python/benchmarks/bench_models.py [--quick] [--models smollm2,llama-150m]
        [--dtypes fp32,bf16] [--modes eager,inductor,topg,llamacpp] [--out bench_results]

Writes ``models.md`` (table), ``models.json`` and ``models.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from torch_topg.bench import Stopwatch, timed
from torch_topg.bench.memory import peak_rss_mb, reset_peak_rss
from torch_topg.bench.models import decode_read_bytes, weights_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONTEXT = 256


def _load(model_name: str, dtype: torch.dtype):
    from torch_topg.models import build_model, load_smollm2

    if model_name == "smollm2":
        return load_smollm2(dtype)[0]
    return build_model(model_name, dtype)


def _decode_ms(fn, ids, steps: int) -> tuple[Stopwatch, Stopwatch]:
    """The decode steps (``steps`` of them) after a prefill of ``ids``, and the prefill."""
    prefill, decode = Stopwatch(), Stopwatch()
    with torch.inference_mode():
        with prefill.lap():
            out = fn(input_ids=ids, use_cache=True)
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            with decode.lap():
                out = fn(input_ids=nxt, past_key_values=cache, use_cache=True)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return decode, prefill


def worker(model_name: str, dtype_name: str, mode: str, quick: bool) -> dict:
    dtype = DTYPES[dtype_name]
    model = _load(model_name, dtype)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, CONTEXT), generator=torch.Generator().manual_seed(0))
    import gc

    gc.collect()
    reset_peak_rss()
    rss0 = peak_rss_mb()
    fn = model
    compile_s = 0.0
    if mode in ("topg", "inductor"):
        import torch_topg  # noqa: F401

        fn = torch.compile(model, backend=mode)
        compile_s = timed(_decode_ms, fn, ids, steps=3)[1]
    else:
        _decode_ms(fn, ids, steps=2)  # warm-up
    steps = 8 if quick else 24
    decode = _decode_ms(fn, ids, steps)[0].ms()
    prefills = Stopwatch()
    for _ in range(2 if quick else 4):
        prefills.samples += _decode_ms(fn, ids, 0)[1].samples
    prefill = prefills.ms()
    rss = peak_rss_mb()
    return {
        "model": model_name,
        "dtype": dtype_name,
        "mode": mode,
        "decode_ms": decode.median,
        "prefill_ms": prefill.median,
        "figures": {"decode": decode.to_dict(), "prefill": prefill.to_dict()},
        "compile_s": compile_s,
        "peak_rss_mb": rss,
        "load_rss_mb": rss0,
        "weights_mb": weights_bytes(model) / 2**20,
        "read_bytes": decode_read_bytes(model, CONTEXT),
    }


def llamacpp_worker(dtype_name: str, quick: bool) -> dict:
    """llama.cpp on the same weights: the shipped GGUF converted to F32 / BF16 with
    llama.cpp's own quantize API, 2 threads, the same prompt length."""
    import llama_cpp

    from torch_topg.models.hf import gguf_path

    ftype = {"fp32": 0, "bf16": 32}[dtype_name]  # LLAMA_FTYPE_ALL_F32 / MOSTLY_BF16
    cache = Path(os.environ.get("TOPG_CACHE_DIR", Path.home() / ".cache" / "torch_topg"))
    dst = cache / f"smollm2-135m-instruct-{dtype_name}.gguf"
    if not dst.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = 2
        rc = llama_cpp.llama_model_quantize(str(gguf_path()).encode(), str(dst).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize failed ({rc})")
    llm = llama_cpp.Llama(
        model_path=str(dst),
        n_ctx=CONTEXT + 64,
        n_batch=CONTEXT,
        n_threads=2,
        n_threads_batch=2,
        verbose=False,
    )
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 40000, (CONTEXT,), generator=g).tolist()
    prefill, decode = Stopwatch(), Stopwatch()
    for _ in range(2 if quick else 3):
        llm.reset()
        with prefill.lap():
            llm.eval(tokens)
        nxt = 42
        for _ in range(8 if quick else 24):
            with decode.lap():
                llm.eval([nxt])
    rss = peak_rss_mb()
    decode, prefill = decode.ms(), prefill.ms()
    return {
        "model": "smollm2",
        "dtype": dtype_name,
        "mode": "llamacpp",
        "decode_ms": decode.median,
        "prefill_ms": prefill.median,
        "figures": {"decode": decode.to_dict(), "prefill": prefill.to_dict()},
        "compile_s": 0.0,
        "peak_rss_mb": rss,
        "load_rss_mb": 0.0,
        "weights_mb": dst.stat().st_size / 2**20,
        "read_bytes": 0,
    }


def _spawn(args: list[str], timeout: float) -> dict | str:
    cmd = [sys.executable, __file__, "--worker", *args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f} s"
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (p.stderr or p.stdout).strip().splitlines()[-3:]
    return "failed: " + " | ".join(tail)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", default="smollm2,llama-150m,mixtral-360m")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--modes", default="eager,inductor,topg,llamacpp")
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        if args.mode == "llamacpp":
            res = llamacpp_worker(args.dtype, args.quick)
        else:
            res = worker(args.model, args.dtype, args.mode, args.quick)
        print(json.dumps(res))
        return

    from torch_topg.bench import describe, machine_info

    machine = machine_info()
    print(describe(machine), flush=True)
    results, notes = [], []
    for model in args.models.split(","):
        for dt in args.dtypes.split(","):
            for mode in args.modes.split(","):
                if mode == "llamacpp" and model != "smollm2":
                    continue
                extra = ["--quick"] if args.quick else []
                r = _spawn(["--model", model, "--dtype", dt, "--mode", mode, *extra], 1800)
                if isinstance(r, str):
                    notes.append(f"{model} {dt} {mode}: {r}")
                    print(notes[-1], flush=True)
                    continue
                results.append(r)
                _write(Path(args.out), machine, results, notes, final=False)
                print(
                    f"{model:<13}{dt:<5}{mode:<9} decode {r['decode_ms']:8.2f} ms  "
                    f"prefill {r['prefill_ms']:9.1f} ms  compile {r['compile_s']:6.1f} s  "
                    f"peak {r['peak_rss_mb']:7.0f} MB",
                    flush=True,
                )
    table = _write(Path(args.out), machine, results, notes, final=True, quick=args.quick)
    print(table)


def to_record(machine: dict, results: list[dict], notes: list[str], quick: bool) -> dict:
    """The run as a ``torch_topg.bench`` record: one row per (model, dtype, mode)."""
    from torch_topg.bench import new_record

    rows = [
        {"key": f"{r['model']} | {r['dtype']} | {r['mode']}", "unit": "ms", **r} for r in results
    ]
    return new_record("models", rows, machine, quick=quick, notes=notes)


def render_record(rec: dict) -> str:
    """The Markdown table of a ``models`` record (render_readme.py's ``models`` block)."""
    from torch_topg.bench import describe

    results = [{k: v for k, v in r.items() if k not in ("key", "unit")} for r in rec["rows"]]
    head = f"Run {rec['date']} at commit {rec['commit']}: {describe(rec['machine'])}\n\n"
    return head + render(results, rec["machine"]["read_bw"]["median"], rec.get("notes", []))


def _write(
    out: Path, machine: dict, results: list[dict], notes: list[str], final: bool, quick=False
) -> str:
    """Writes the table and JSON (after every configuration, so an interrupted run keeps
    what it measured) and, at the end, the plot and the record."""
    out.mkdir(parents=True, exist_ok=True)
    bw = machine["read_bw"]["median"]
    data = {"bandwidth": bw, "results": results, "notes": notes}
    (out / "models.json").write_text(json.dumps(data, indent=1))
    table = render(results, bw, notes)
    (out / "models.md").write_text(table)
    if final:
        from torch_topg.bench import write_record

        print(f"wrote {write_record(to_record(machine, results, notes, quick), out)}")
        try:
            plot(results, out / "models.png")
        except Exception as e:  # matplotlib missing or headless trouble: the table is the record
            print(f"plot skipped: {e}")
    return table


def render(results: list[dict], bw: float, notes: list[str]) -> str:
    by = {(r["model"], r["dtype"], r["mode"]): r for r in results}
    lines = [
        f"Read bandwidth measured in this run: {bw / 1e9:.1f} GB/s. Context 256, batch 1.",
        "",
        "| model | dtype | decode ms: eager / Inductor / topg / llama.cpp | topg vs Inductor | "
        "topg vs llama.cpp | decode limit ms (topg % of it) | prefill ms: eager / Inductor / "
        "topg | topg vs Inductor | compile s: Inductor / topg (ratio) | peak RSS MB: eager / "
        "topg (ratio) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def g(key, field, fmt="{:.2f}"):
        r = by.get(key)
        if not r:
            return "-"
        fig = r.get("figures", {}).get(field.removesuffix("_ms"))
        if fig and fig["n"] > 1:  # the median, then the spread
            lo, hi = fmt.format(fig["lo"]), fmt.format(fig["hi"])
            return f"{fmt.format(r[field])} [{lo}-{hi}]"
        return fmt.format(r[field])

    for model, dt in sorted({(r["model"], r["dtype"]) for r in results}):
        e, i, t, c = ((model, dt, m) for m in ("eager", "inductor", "topg", "llamacpp"))
        tr = by.get(t)
        limit = (
            f"{tr['read_bytes'] / bw * 1e3:.1f} ({tr['read_bytes'] / bw * 1e5 / tr['decode_ms']:.0f}%)"
            if tr
            else "-"
        )

        def ratio(a, b, field):
            ra, rb = by.get(a), by.get(b)
            if not ra or not rb or not rb[field]:
                return "-"
            return f"{ra[field] / rb[field]:.2f}x"

        lines.append(
            f"| {model} | {dt} | {g(e, 'decode_ms')} / {g(i, 'decode_ms')} / {g(t, 'decode_ms')}"
            f" / {g(c, 'decode_ms')} | {ratio(t, i, 'decode_ms')} | {ratio(t, c, 'decode_ms')} "
            f"| {limit} | {g(e, 'prefill_ms', '{:.0f}')} / {g(i, 'prefill_ms', '{:.0f}')} / "
            f"{g(t, 'prefill_ms', '{:.0f}')} | {ratio(t, i, 'prefill_ms')} | "
            f"{g(i, 'compile_s', '{:.0f}')} / {g(t, 'compile_s', '{:.0f}')} "
            f"({ratio(t, i, 'compile_s')}) | {g(e, 'peak_rss_mb', '{:.0f}')} / "
            f"{g(t, 'peak_rss_mb', '{:.0f}')} ({ratio(t, e, 'peak_rss_mb')}) |"
        )
    lines += [
        "",
        "Cells: median [spread: min-max, or p10-p90 over 10 or more]; decode over the steps "
        "of one process, prefill over its repeats. Each mode runs in its own process, so "
        "ratios are of medians, not per round. "
        "Ratios are time / time (lower is better for topg): targets are decode <= "
        "0.7x Inductor and <= 1.0x llama.cpp, prefill <= 0.9x Inductor, compile <= 0.2x "
        "Inductor, decode within 1.3x of the limit, peak memory <= 1.1x eager.",
    ]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["model"], r["dtype"]) for r in results})
    modes = ["eager", "inductor", "topg", "llamacpp"]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.2
    for j, mode in enumerate(modes):
        xs, ys = [], []
        for i, k in enumerate(keys):
            r = next(
                (r for r in results if (r["model"], r["dtype"], r["mode"]) == (*k, mode)), None
            )
            if r:
                xs.append(i + (j - 1.5) * width)
                ys.append(r["decode_ms"])
        ax.bar(xs, ys, width, label=mode)
    ax.set_xticks(range(len(keys)), [f"{m}\n{d}" for m, d in keys])
    ax.set_ylabel("decode step, ms (lower is better)")
    ax.set_title("Decode step, batch 1, context 256, 2 CPU threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
