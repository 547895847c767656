"""The engine benchmark's llama.cpp side: the GGUF in F32 / BF16, ``llama-server``
under 16 concurrent requests, ``llama-bench`` at batch 1, ``llama-batched-bench``'s
decode step at batch 1 and 8."""

from __future__ import annotations

import http.client
import json
import os
import shlex
import socket
import subprocess
import threading
import time
from pathlib import Path

from engine_common import (
    CONCURRENCY,
    DECODE_CONTEXT,
    DECODE_TOKENS,
    THREADS,
    TTFT_PROMPT,
    med,
)

from torch_topg.bench import Stopwatch
from torch_topg.bench.memory import peak_rss_mb, rss_mb

#: gguf_for's targets: llama-quantize's type names.
GGUF_KINDS = {"fp32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_0": "Q4_0", "q4_k_m": "Q4_K_M",
              "q5_k_m": "Q5_K_M", "q6_k": "Q6_K"}  # fmt: skip


def gguf_for(dtype: str, quantize: Path) -> Path:
    """SmolLM2's shipped GGUF (Q4_1) converted to F32 / BF16 (or re-quantised to Q8_0 /
    Q4_0) with llama.cpp's quantizer (--allow-requantize de-quantises first), at the path
    bench_models.py uses (shared cache)."""
    from torch_topg.models.hf import gguf_path

    cache = Path(os.environ.get("TOPG_CACHE_DIR", Path.home() / ".cache" / "torch_topg"))
    dst = cache / f"smollm2-135m-instruct-{dtype}.gguf"
    if not dst.exists():
        tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
        kind = GGUF_KINDS[dtype]
        p = subprocess.run(
            [str(quantize), "--allow-requantize", str(gguf_path()), str(tmp), kind, str(THREADS)],
            capture_output=True,
            text=True,
        )
        if p.returncode != 0 or not tmp.exists():
            raise RuntimeError(f"llama-quantize failed ({p.returncode}): {p.stderr[-500:]}")
        tmp.rename(dst)
    return dst


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout: float = 1800) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        c.close()


def _wait_health(port: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/health")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not healthy after {timeout:.0f} s")


def run_llama_server(
    server: Path, gguf: Path, ids: list[list[int]], rounds: int, new_tokens: int, log: Path
) -> dict:
    """``llama-server --parallel 16`` on localhost; each round sends the 16 prompts as 16
    concurrent /completion requests (token ids, n_predict, ignore_eos, greedy, no prompt
    cache); wall time from the first submit to the last completion."""
    per_slot = -(-(max(len(x) for x in ids) + new_tokens) // 256) * 256
    port = _free_port()
    cmd = [
        str(server), "-m", str(gguf), "--parallel", str(CONCURRENCY),
        "-c", str(per_slot * CONCURRENCY), "-t", str(THREADS), "-tb", str(THREADS),
        "--host", "127.0.0.1", "--port", str(port), "--no-webui", "--cache-ram", "0",
    ]  # fmt: skip
    with open(log, "w") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT)
    try:
        _wait_health(port, proc)
        rss_load = rss_mb(proc.pid)

        def one_round() -> tuple[float, list[dict]]:
            res: list[dict | BaseException | None] = [None] * len(ids)

            def go(j: int) -> None:
                body = {
                    "prompt": ids[j],
                    "n_predict": new_tokens,
                    "ignore_eos": True,
                    "temperature": 0,
                    "cache_prompt": False,
                    "return_tokens": True,
                }
                try:
                    res[j] = _post(port, "/completion", body)
                except BaseException as e:  # reported below
                    res[j] = e

            threads = [threading.Thread(target=go, args=(j,)) for j in range(len(ids))]
            sw = Stopwatch()
            with sw.lap():
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            wall = sw.last
            errs = [r for r in res if isinstance(r, BaseException)]
            if errs:
                raise RuntimeError(f"request failed: {errs[0]!r}")
            return wall, res  # type: ignore[return-value]

        one_round()  # warm-up
        walls, rss_after, tokens, problems = [], [], None, []
        for _ in range(rounds):
            wall, res = one_round()
            walls.append(wall)
            rss_after.append(rss_mb(proc.pid))
            toks = [r.get("tokens") or [] for r in res]
            n_pred = [r.get("tokens_predicted") for r in res]
            if any(n != new_tokens for n in n_pred):
                problems.append(f"tokens_predicted {sorted(set(map(str, n_pred)))}")
            # every prompt token evaluated (no KV reuse between the requests)
            n_prompt = sum((r.get("timings") or {}).get("prompt_n", 0) for r in res)
            if n_prompt != sum(len(x) for x in ids):
                problems.append(f"prompt tokens evaluated {n_prompt}, sent {sum(map(len, ids))}")
            tokens = tokens or toks
        peak = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {
        "system": "llama-server",
        "cmd": shlex.join(cmd),
        "walls_s": walls,
        "tokens_per_round": CONCURRENCY * new_tokens,
        "tokens": tokens,
        "rss_load_mb": rss_load,
        "rss_after_rounds_mb": rss_after,
        "peak_rss_mb": peak,
        "problems": problems,
    }


def _llama_bench(bench: Path, gguf: Path, repeats: int, extra: list[str]) -> tuple[dict, str]:
    """One ``llama-bench`` call: its first JSON row and the command."""
    cmd = [str(bench), "-m", str(gguf), "-t", str(THREADS), "-r", str(repeats), "-o", "json",
           *extra]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}: {p.stderr[-400:]}")
    return json.loads(p.stdout)[0], shlex.join(cmd)


DECODE_ARGS = ["-p", "0", "-n", str(DECODE_TOKENS), "-d", str(DECODE_CONTEXT)]


def llama_decode_samples(bench: Path, gguf: Path, repeats: int = 1) -> tuple[list[float], str]:
    """``llama-bench -p 0 -n 64 -d 256``: ms per decode token of each of ``repeats`` runs,
    and the command (one call per round lets a benchmark interleave it with its own)."""
    row, cmd = _llama_bench(bench, gguf, repeats, DECODE_ARGS)
    return [x / 1e6 / DECODE_TOKENS for x in row["samples_ns"]], cmd


def llama_batched_step_ms(
    batched: Path, gguf: Path, batches: tuple[int, ...] = (1, 8)
) -> tuple[dict[int, float], str]:
    """``llama-batched-bench``: ms per decode step of ``b`` sequences for each ``b`` in
    ``batches``, DECODE_TOKENS steps after a DECODE_CONTEXT-token prompt (``-pps``: the
    prompt is prefilled once and copied to every sequence's own cache; the decode steps
    read each sequence's cache as with distinct prompts), and the command."""
    n_ctx = max(batches) * (DECODE_CONTEXT + DECODE_TOKENS)
    cmd = [str(batched), "-m", str(gguf), "-t", str(THREADS), "-c", str(n_ctx), "-pps",
           "-npp", str(DECODE_CONTEXT), "-ntg", str(DECODE_TOKENS),
           "-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    got = {r["pl"]: r["t_tg"] / r["tg"] * 1e3 for r in rows}
    if p.returncode != 0 or set(got) != set(batches):
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode} with rows for "
                           f"{sorted(got)}: {p.stderr[-400:]}")  # fmt: skip
    return got, shlex.join(cmd)


def run_llama_bench(bench: Path, gguf: Path, repeats: int) -> dict:
    """``llama-bench -p 512 -n 0`` (prefill of 512 tokens = TTFT less sampling) and
    ``-p 0 -n 64 -d 256`` (64 decode steps after a 256-token context)."""
    out = {}
    for key, extra in (
        ("ttft_ms", ["-p", str(TTFT_PROMPT), "-n", "0"]),
        ("decode_ms", DECODE_ARGS),
    ):
        row, cmd = _llama_bench(bench, gguf, repeats, extra)
        per = 1 if key == "ttft_ms" else DECODE_TOKENS
        out[key] = med([x / 1e6 / per for x in row["samples_ns"]])
        out[key + "_cmd"] = cmd
        out["flash_attn"] = row.get("flash_attn")
        out["build"] = f"{row.get('build_commit')} ({row.get('build_number')})"
        variant = Path(bench).parent.parent / "variant.txt"  # llama_cpp_build.py writes it
        if variant.exists():
            out["build"] += ", " + variant.read_text().strip()
    return out


# --- orchestration ----------------------------------------------------------------------
