"""Concurrent requests through ``serve`` and llama-server on the real-size GGUF files, with
each server's load time (process start to the first token) and peak RSS.

    python python/benchmarks/real_size_serve.py --shape llama-3.2-1b \\
        --formats bf16,q4_0,q4_k_m [--concurrency 16 --requests 32 --max-tokens 128]

The files are real_size.py's (the shape's BF16 GGUF from llama.cpp's converter, each
format from llama-quantize; made here if absent, quantised files deleted afterwards
unless --keep). Per format both servers start side by side on the same file, 2 threads
each: ``python -m torch_topg serve --model FILE --quantization gguf`` (the BF16 file:
``--dtype bfloat16``, no quantisation) with ``--max-batch-size`` = concurrency and
``--max-model-len`` = the context per slot, and ``llama-server -m FILE --parallel C
-c C*ctx -t 2 -tb 2 --jinja`` (flash attention ``auto``, its default; the same KV pool:
C slots of ctx tokens in 16-bit on both sides). Load time is measured from the process'
start to the first token of a one-token request, with the engine's metadata cache warm
(the conversion of a file's config and tokenizer, once per file, is timed apart and
reported beside it); peak RSS is the process' ``VmHWM`` after the run. Then, after a
warm-up at full concurrency, ``repeats`` rounds of the
``chat`` dataset (``torch_topg.client.loadgen``: streamed chat completions, greedy,
``ignore_eos``, exactly ``--max-tokens`` each), each round to both servers in a rotated
order. Output tokens/s per round; the median and the range are reported. The weights
are random: speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from real_size import format_files, save_rows  # noqa: E402
from serving import free_port, wait_healthy, wait_warm  # noqa: E402

from torch_topg.bench.timing import summarize  # noqa: E402
from torch_topg.client.datasets import make_requests  # noqa: E402
from torch_topg.client.loadgen import run_level, served_model  # noqa: E402

THREADS = 2


def peak_rss(pid: int) -> int:
    """The process' peak resident set (``VmHWM``) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


class Server:
    """A server process on one file: started, timed to its first token, measured, stopped."""

    def __init__(self, name: str, cmd: list[str], port: int, log: Path) -> None:
        self.name, self.cmd, self.log = name, cmd, log
        self.url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
        t0 = time.monotonic()
        with open(log, "w") as lf:
            lf.write(f"$ {' '.join(cmd)}\n")
            lf.flush()
            self.proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, env=env)
        wait_healthy(self.url, self.proc, log, 1800.0)
        self.model = served_model(self.url)
        first = self.level(make_requests("chat", 1, seed=7), 1, 1)
        if first["completed"] != 1:
            raise RuntimeError(f"{name}: the first request failed: {first['errors']}; log {log}")
        self.load_s = time.monotonic() - t0
        wait_warm(self.url)  # the rounds measure the steady state
        self.rounds: list[dict] = []

    def level(self, reqs: list, concurrency: int, max_tokens: int) -> dict:
        extra = {"temperature": 0, "ignore_eos": True}
        return asyncio.run(run_level(self.url, self.model, reqs, concurrency, max_tokens, extra))

    def stop(self) -> int:
        """Stop the process; its peak RSS in bytes (read before it exits)."""
        rss = peak_rss(self.proc.pid)
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return rss


def commands(path: Path, fmt: str, c: int, ctx: int, llama_server: str) -> dict[str, list[str]]:
    q = ["--dtype", "bfloat16"] if fmt == "bf16" else ["--quantization", "gguf"]
    topg = [sys.executable, "-m", "torch_topg", "serve", "--model", str(path), *q,
            "--max-batch-size", str(c), "--max-model-len", str(ctx), "--log-level", "warning",
            "--port", str(free_port())]  # fmt: skip
    llama = [llama_server, "-m", str(path), "--parallel", str(c), "-c", str(c * ctx),
             "-t", str(THREADS), "-tb", str(THREADS), "--host", "127.0.0.1", "--no-webui",
             "--jinja", "--port", str(free_port())]  # fmt: skip
    return {"topg": topg, "llama-server": llama}


def first_read_s(path: Path) -> float:
    """Seconds the engine's one-time conversion of a file's metadata (config, tokenizer)
    takes, in a process of its own; afterwards it comes from the cache
    (``~/.cache/torch_topg/gguf-meta``), so the server's load measured next is a
    returning user's (this figure is added for a first load)."""
    code = ("import sys, time; from torch_topg.engine.gguf_meta import config_and_tokenizer; "
            "t = time.monotonic(); config_and_tokenizer(sys.argv[1]); "
            "print(time.monotonic() - t)")  # fmt: skip
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"reading {path.name}'s metadata failed: {p.stderr[-400:]}")
    return float(p.stdout.split()[-1])


def run_format(shape: str, fmt: str, path: Path, a: argparse.Namespace, llama_server: str) -> dict:
    cmds = commands(path, fmt, a.concurrency, a.ctx_per_slot, llama_server)
    meta_s = first_read_s(path)
    servers: dict[str, Server] = {}
    rss: dict[str, int] = {}
    log_dir = Path(a.out)
    try:
        for name, cmd in cmds.items():  # one at a time: each load has the machine to itself
            port = int(cmd[-1])
            log = log_dir / f"real_size_serve-{shape}-{fmt}-{name}.log"
            servers[name] = Server(name, cmd, port, log)
            print(f"[{shape} {fmt}] {name}: first token {servers[name].load_s:.1f} s after start",
                  flush=True)  # fmt: skip
        warm = make_requests("chat", a.concurrency, seed=1)
        for s in servers.values():
            s.level(warm, a.concurrency, 8)
        reqs = make_requests("chat", a.requests, seed=0)
        names = list(servers)
        for r in range(a.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                lv = servers[name].level(reqs, a.concurrency, a.max_tokens)
                if lv["failed"] or lv["output_tokens"] != a.requests * a.max_tokens:
                    raise RuntimeError(f"{name}: {lv['failed']} failed, {lv['output_tokens']} "
                                       f"tokens of {a.requests * a.max_tokens}: {lv['errors']}")  # fmt: skip
                servers[name].rounds.append(lv)
                print(f"[{shape} {fmt}] {name} round {r}: {lv['output_tokens_per_s']:.1f} tok/s",
                      flush=True)  # fmt: skip
    finally:
        for name, s in servers.items():
            rss[name] = s.stop()
    tps = {n: summarize([lv["output_tokens_per_s"] for lv in s.rounds]) for n, s in servers.items()}
    ttft = {n: statistics.median(lv["latency_ms"]["ttft"]["p50"] for lv in s.rounds)
            for n, s in servers.items()}  # fmt: skip
    lc = tps["llama-server"].median
    row = {
        "key": f"{shape} | {fmt} | serve c={a.concurrency}",
        "shape": shape,
        "format": fmt,
        "unit": "output tokens/s",
        "concurrency": a.concurrency,
        "requests": a.requests,
        "max_tokens": a.max_tokens,
        "figures": {k: v.to_dict() for k, v in tps.items()},
        "ratios": {"topg / llama-server": tps["topg"].scaled(1 / lc).to_dict()},
        "ttft_p50_ms": ttft,
        "load_s": {n: s.load_s for n, s in servers.items()},
        "topg_metadata_conversion_s": meta_s,
        "peak_rss_bytes": rss,
        "cmds": {n: " ".join(c) for n, c in cmds.items()},
    }
    print(f"[{shape} {fmt}] tokens/s topg {tps['topg'].fmt()} llama-server "
          f"{tps['llama-server'].fmt()} ({tps['topg'].median / lc:.2f}x); load "
          f"{row['load_s']['topg']:.1f} / {row['load_s']['llama-server']:.1f} s; peak RSS "
          f"{rss['topg'] / 2**30:.2f} / {rss['llama-server'] / 2**30:.2f} GiB", flush=True)  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--formats", default="bf16,q4_0,q4_k_m")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ctx-per-slot", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the quantised files")
    ap.add_argument("--out", default="bench_results")
    a = ap.parse_args(argv)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    for fmt, path, llama in format_files(a.shape, a.formats, a.keep):
        row = run_format(a.shape, fmt, path, a, llama["llama-server"])
        save_rows("real_size_serve", [row],
                  [f"{THREADS} threads per server; chat dataset, greedy, ignore_eos"], a.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
