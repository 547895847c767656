"""Serving benchmark: the topg server (``python -m torch_topg serve``) against llama.cpp's
``llama-server``, one run, same machine, same weights, same requests, 2 threads each.

Weights: SmolLM2-135M-Instruct, the engine's default model, and for llama-server the
same GGUF converted to F32 / BF16 (``engine_llama.gguf_for``). llama-server is built
once from the sources vendored in llama-cpp-python (``llama_cpp_build.py``; if that fails
the run says why and measures topg alone), runs with ``--jinja`` (the GGUF's own chat
template) and ``--parallel`` equal to the concurrency, otherwise its defaults (its
prompt cache on: it reuses a slot's prefix, which ``shared-prefix`` rewards). Requests
are streamed chat completions sent by ``torch_topg.client.loadgen`` (the ``bench serve``
load generator): greedy, ``ignore_eos``, ``--max-tokens`` each, at each concurrency level
on the ``chat`` and ``shared-prefix`` datasets; per level output tokens/s and TTFT / TPOT
/ ITL / e2e percentiles on the client's clock. Both servers are up side by side and each
level goes to topg, then at once to llama-server, so both meet the machine in the same
state (a shared machine's load moves over minutes); the load average is recorded per level.

    python python/benchmarks/serving.py [--dtype fp32,bf16] [--datasets chat,shared-prefix]
        [--concurrency 1,4,16] [--requests 6,16,32] [--max-tokens 64] [--prefix-len 128]
        [--systems topg,llama] [--out bench_results] [--md bench_results/serving.md] [--quick]

Writes a ``torch_topg.bench/1`` record (``bench_results/serving-<date>-<commit>.json``),
a Markdown report (``--md``) and the servers' logs (``bench_results/serving-*.log``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_llama import gguf_for  # noqa: E402
from llama_cpp_build import LlamaCppUnavailable, ensure_llama_cpp  # noqa: E402

from torch_topg.bench.machine import machine_info  # noqa: E402
from torch_topg.bench.record import new_record, validate, write_record  # noqa: E402
from torch_topg.client.datasets import make_requests  # noqa: E402
from torch_topg.client.loadgen import level_row, run_level, served_model  # noqa: E402

THREADS = 2
CTX_PER_SLOT = 1024  # llama-server's -c is split between its slots
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
# Targets (the serving issue): at c=16 >= 1.0x llama-server's output tokens/s, a lower
# p90 TTFT on shared-prefix; at c=1 TPOT within 1.1x (bf16) / 1.2x (fp32) of llama-server's.
TPOT_TARGET = {"bf16": 1.1, "fp32": 1.2}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    """Return once ``GET url/health`` answers 200; RuntimeError naming the log if ``proc``
    exits first or ``timeout`` seconds pass."""
    name = proc.args[0] if isinstance(proc.args, list) else proc.args
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; log: {log}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} not healthy after {timeout:.0f} s; log: {log}")
        time.sleep(0.25)


def wait_warm(url: str, timeout: float = 600.0) -> None:
    """Return once ``GET url/health`` no longer says ``"warm": false`` (topg's warm-up
    compiles in the background while it already serves: steady-state figures wait for it;
    llama-server's health has no such field)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if json.load(r).get("warm", True):
                    return
        time.sleep(0.25)
    raise RuntimeError(f"{url}: still warming up after {timeout:.0f} s")


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None,
           timeout: float = 1200.0) -> Iterator[str]:  # fmt: skip
    """Start ``cmd``, wait until ``GET /health`` answers 200, yield the base URL, stop it."""
    url = f"http://127.0.0.1:{port}"
    with open(log, "w") as lf:
        lf.write(f"$ {shlex.join(cmd)}\n")
        lf.flush()
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(url, proc, log, timeout)
        wait_warm(url, timeout)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def topg_cmd(dtype: str, port: int, max_batch: int) -> list[str]:
    return [sys.executable, "-m", "torch_topg", "serve", "--port", str(port),
            "--dtype", TORCH_DTYPE[dtype], "--max-batch-size", str(max_batch),
            "--log-level", "warning"]  # fmt: skip


def llama_cmd(binary: Path, gguf: Path, port: int, parallel: int) -> list[str]:
    return [str(binary), "-m", str(gguf), "--parallel", str(parallel),
            "-c", str(CTX_PER_SLOT * parallel), "-t", str(THREADS), "-tb", str(THREADS),
            "--host", "127.0.0.1", "--port", str(port), "--no-webui", "--jinja"]  # fmt: skip


def measure(
    system: str, url: str, dataset: str, concurrency: int, n: int, args: argparse.Namespace
) -> dict:
    """One level: ``n`` requests of ``dataset`` with ``concurrency`` in flight."""
    reqs = make_requests(dataset, n, seed=0, prefix_len=args.prefix_len)
    extra = {"temperature": 0, "ignore_eos": True}
    load = os.getloadavg()[0]
    model = served_model(url)
    lv = asyncio.run(run_level(url, model, reqs, concurrency, args.max_tokens, extra))
    lv["load_avg_1min_before"] = load
    lat = lv["latency_ms"]
    p = lambda k, q: "-" if lat[k] is None else f"{lat[k][q]:.0f}"  # noqa: E731
    print(f"  {system:5s} {dataset:13s} c={concurrency:<3d} {lv['completed']}/{lv['requests']} ok  "
          f"{lv['output_tokens_per_s']:7.1f} tok/s  TTFT p50/p90 {p('ttft', 'p50')}/"
          f"{p('ttft', 'p90')} ms  TPOT p50/p90 {p('tpot', 'p50')}/{p('tpot', 'p90')} ms  "
          f"(load {load:.1f})", flush=True)  # fmt: skip
    if lv["errors"]:
        print(f"    errors: {lv['errors']}", flush=True)
    return lv


def warm_up(url: str, args: argparse.Namespace) -> None:
    reqs = make_requests("chat", 2, seed=1)
    extra = {"temperature": 0, "ignore_eos": True}
    asyncio.run(run_level(url, served_model(url), reqs, 2, 8, extra))


def run_dtype(
    dtype: str, args: argparse.Namespace, bins: dict | None, notes: list[str]
) -> list[dict]:
    """Every (concurrency, dataset) level of both systems in one dtype, interleaved: the
    topg server stays up; per level a llama-server with ``--parallel`` = concurrency
    starts, then each dataset is sent to topg, then to llama-server, so that both see
    the machine in the same state (it is shared). Rows of the record."""
    rows: list[dict] = []
    log_dir = Path(args.out)
    log_dir.mkdir(parents=True, exist_ok=True)

    def row(system: str, lv: dict, dataset: str, cmd: list[str]) -> dict:
        key = f"{system} | {dtype} | {dataset} | c={lv['concurrency']}"
        return {**level_row(lv, key), "system": system, "dtype": dtype, "dataset": dataset,
                "max_tokens": args.max_tokens, "cmd": shlex.join(cmd)}  # fmt: skip

    def start(stack: contextlib.ExitStack, name: str, cmd: list[str], port: int, log: Path,
              env: dict[str, str] | None = None) -> str | None:  # fmt: skip
        try:
            url = stack.enter_context(server(cmd, port, log, env))
        except Exception as e:  # a server that fails: say so, measure the other
            notes.append(f"{name} {dtype} failed: {e}")
            print(f"  {name} failed: {e}", flush=True)
            return None
        warm_up(url, args)
        return url

    with contextlib.ExitStack() as outer:
        topg = None
        if "topg" in args.systems:
            port = free_port()
            tcmd = topg_cmd(dtype, port, max(args.concurrency))
            env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
            topg = start(outer, "topg", tcmd, port, log_dir / f"serving-topg-{dtype}.log", env)
        gguf = gguf_for(dtype, bins["llama-quantize"]) if bins is not None else None
        for c, n in zip(args.concurrency, args.requests, strict=True):
            with contextlib.ExitStack() as inner:
                llama = None
                if gguf is not None and bins is not None:
                    port = free_port()
                    lcmd = llama_cmd(bins["llama-server"], gguf, port, c)
                    log = log_dir / f"serving-llama-{dtype}-c{c}.log"
                    llama = start(inner, "llama-server", lcmd, port, log)
                for dataset in args.datasets:
                    if topg is not None:
                        rows.append(
                            row("topg", measure("topg", topg, dataset, c, n, args), dataset, tcmd)
                        )
                    if llama is not None:
                        rows.append(
                            row(
                                "llama", measure("llama", llama, dataset, c, n, args), dataset, lcmd
                            )
                        )
    return rows


# --- the report -------------------------------------------------------------------------
def _get(rows: list[dict], system: str, dtype: str, dataset: str, c: int) -> dict | None:
    return next((r for r in rows if (r["system"], r["dtype"], r["dataset"], r["concurrency"])
                 == (system, dtype, dataset, c)), None)  # fmt: skip


def _lat(r: dict | None, k: str, q: str) -> float | None:
    s = r and r["latency_ms"][k]
    return None if not s else s[q]


def _f(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else f"{x:{spec}}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def report(rows: list[dict], args: argparse.Namespace, notes: list[str]) -> str:
    """Per dtype a table (topg / llama-server per figure) and the targets' verdicts."""
    out = []
    for dtype in args.dtype:
        out += [f"### {dtype}", "",
                "| dataset | c | out tok/s topg / llama (ratio) | TTFT p50 ms | TTFT p90 ms "
                "| TPOT p50 ms | TPOT p90 ms | prompt tok/req |",
                "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for dataset in args.datasets:
            for c in args.concurrency:
                t, ll = (
                    _get(rows, "topg", dtype, dataset, c),
                    _get(rows, "llama", dtype, dataset, c),
                )
                tps = [r and r["output_tokens_per_s"] for r in (t, ll)]
                cells = [dataset, str(c), f"{_f(tps[0], '.1f')} / {_f(tps[1], '.1f')} "
                         f"({_ratio(tps[0], tps[1])})"]  # fmt: skip
                for k, q in (("ttft", "p50"), ("ttft", "p90"), ("tpot", "p50"), ("tpot", "p90")):
                    cells.append(f"{_f(_lat(t, k, q))} / {_f(_lat(ll, k, q))}")
                ptok = [r and r["prompt_tokens"] and r["prompt_tokens"] / r["completed"]
                        for r in (t, ll)]  # fmt: skip
                cells.append(f"{_f(ptok[0])} / {_f(ptok[1])}")
                out.append("| " + " | ".join(cells) + " |")
        out += ["", *targets(rows, dtype, args), ""]
    return "\n".join([*notes, "", *out])


def targets(rows: list[dict], dtype: str, args: argparse.Namespace) -> list[str]:
    lines = []
    top = max(args.concurrency)
    for dataset in args.datasets:
        t, ll = _get(rows, "topg", dtype, dataset, top), _get(rows, "llama", dtype, dataset, top)
        if t and ll:
            r = t["output_tokens_per_s"] / ll["output_tokens_per_s"]
            lines.append(f"- c={top} {dataset}: output tokens/s {r:.2f}x llama-server's "
                         f"(target >= 1.0x: {'met' if r >= 1.0 else 'missed'})")  # fmt: skip
    t, ll = _get(rows, "topg", dtype, "shared-prefix", top), _get(rows, "llama", dtype,
                                                                   "shared-prefix", top)  # fmt: skip
    a, b = _lat(t, "ttft", "p90"), _lat(ll, "ttft", "p90")
    if a is not None and b is not None:
        lines.append(f"- c={top} shared-prefix: p90 TTFT {a:.0f} vs {b:.0f} ms "
                     f"(target lower: {'met' if a < b else 'missed'})")  # fmt: skip
    lo = min(args.concurrency)
    for dataset in args.datasets:
        a = _lat(_get(rows, "topg", dtype, dataset, lo), "tpot", "p50")
        b = _lat(_get(rows, "llama", dtype, dataset, lo), "tpot", "p50")
        if a is not None and b:
            lim = TPOT_TARGET[dtype]
            lines.append(f"- c={lo} {dataset}: TPOT p50 {a:.1f} vs {b:.1f} ms = {a / b:.2f}x "
                         f"(target <= {lim}x: {'met' if a / b <= lim else 'missed'})")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    words = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--dtype", type=words, default=["fp32", "bf16"])
    ap.add_argument("--datasets", type=words, default=["chat", "shared-prefix"])
    ap.add_argument("--concurrency", type=ints, default=[1, 4, 16])
    ap.add_argument("--requests", type=ints, default=[6, 16, 32], help="per level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=128, help="words of the shared prefix")
    ap.add_argument("--systems", type=words, default=["topg", "llama"])
    ap.add_argument("--out", default="bench_results", help="record and logs go here")
    ap.add_argument("--md", default=None, help="also write the report here")
    ap.add_argument("--quick", action="store_true", help="fp32, 4/8/16 requests, 32 tokens")
    args = ap.parse_args(argv)
    if args.quick:
        args.dtype, args.requests, args.max_tokens = ["fp32"], [4, 8, 16], 32
    if len(args.requests) != len(args.concurrency):
        ap.error("--requests needs one count per --concurrency level")
    machine = machine_info(measure=True)
    notes = [f"serving benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
             f"{THREADS} threads per server; max_tokens={args.max_tokens}, greedy, ignore_eos; "
             f"requests per level {args.requests} at concurrency {args.concurrency}; "
             f"shared-prefix: {args.prefix_len} words of system prompt"]  # fmt: skip
    bins = None
    if "llama" in args.systems:
        try:
            bins = ensure_llama_cpp()
        except LlamaCppUnavailable as e:
            notes.append(f"llama-server unavailable, measured topg alone: {e}")
            args.systems = [s for s in args.systems if s != "llama"]
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    argv_ = ["python", "python/benchmarks/serving.py", *(argv or sys.argv[1:])]
    for i, dtype in enumerate(args.dtype):
        print(dtype, flush=True)
        rows += run_dtype(dtype, args, bins, notes)
        done = i + 1 == len(args.dtype)
        tail = [f"wall time {time.monotonic() - t0:.0f} s" + ("" if done else " (so far)")]
        # written after each dtype (the same file): a run stopped later keeps what it measured
        rec = new_record("serving", rows, machine, quick=args.quick, notes=notes + tail,
                         argv=argv_, date=date)  # fmt: skip
        path = write_record(validate(rec), args.out)
    notes.append(tail[0])
    text = report(rows, args, notes)
    print("\n" + text + f"\nrecord: {path}")
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0 if rows and all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
