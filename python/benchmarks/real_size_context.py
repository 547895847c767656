"""Prefill and decode against context length on the real-size GGUF files, side by side
with llama.cpp: the time to first token of a ``ctx``-token prompt and the decode time per
token after it.

    python python/benchmarks/real_size_context.py --shape llama-3.2-1b \\
        --formats bf16,q4_k_m --contexts 2048 --repeats 3          # prefill of 2,048 tokens
    python python/benchmarks/real_size_context.py --formats q4_k_m \\
        --contexts 4096,16384 --repeats 1 --llama-fa 1             # long contexts
    python python/benchmarks/real_size_context.py --shape llama-3.1-8b \\
        --formats q4_k_m,bf16 --contexts 2048 --measure prefill --repeats 1 --llama-fa 1

The files are real_size.py's (made here if absent; quantised files deleted afterwards
unless --keep). Per format one engine (``Engine.from_pretrained(FILE, quantization=
"gguf")``; BF16: the file in bf16; batch 1, no prefix caching, the default prefill chunk
of 512 tokens, the context limit the largest context plus the decode tokens); per context
``repeats`` rounds, each in a rotated order of:

* topg: ``generate`` of a random ``ctx``-token prompt with ``1 + --decode-tokens`` new
  tokens: its TTFT (prefill and the first token's sampling) and the mean time per token
  after the first;
* llama.cpp: ``llama-bench -p ctx -n 0`` (prefill, no sampling) and ``llama-bench -p 0 -n
  N -d ctx`` (N decode steps after a ctx-token context), 2 threads, flash attention as
  ``--llama-fa`` says (both by default, the faster kept per figure; the 16k and 32k runs
  take minutes per call, so they may name one; from 4,096 tokens llama-bench's prefill
  runs without its warm-up pass, which would run the whole prompt once more;
  ``--llama-fa-decode`` sets the decode figures' apart: at 1B and 2,048 tokens flash
  attention was the faster prefill and the slower decode).

``--measure prefill`` leaves the decode figures out (the 8B prefill target). Where the two
sides do not fit in memory together (8B: each holds the file's bytes), they take turns:
the engine's rounds, then llama.cpp's (the record's ``order`` says which).

The weights are random: speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from real_size import forget_engines, format_files, machine, save_rows  # noqa: E402

from torch_topg.bench.memory import sides_fit  # noqa: E402
from torch_topg.bench.timing import summarize, timed  # noqa: E402

THREADS = 2
LONG = 4096  # contexts from here on: llama-bench's prefill without its warm-up pass


class Topg:
    def __init__(
        self, path: Path, fmt: str, max_len: int, decode_tokens: int, measure: list[str]
    ) -> None:
        from torch_topg.engine import Engine

        kw = {"dtype": "bfloat16"} if fmt == "bf16" else {"quantization": "gguf"}
        self.eng, self.load_s = timed(Engine.from_pretrained, str(path), max_batch_size=1,
                                      max_model_len=max_len, prefix_caching=False, **kw)  # fmt: skip
        self.n = decode_tokens if "decode" in measure else 0
        self.rng = random.Random(0)
        self.samples: dict[int, dict[str, list[float]]] = {}
        self.eng.wait_warm()  # the warm-up's background compile (engine.md)
        self.generate(min(512, max_len // 2))  # warm-up: the compiled prefill and decode steps

    def generate(self, ctx: int) -> tuple[float, float]:
        ids = [self.rng.randrange(10, 40000) for _ in range(ctx)]
        o = self.eng.generate(ids, max_new_tokens=1 + self.n, temperature=0, ignore_eos=True)
        tt = o[0].outputs[0].token_times
        return o[0].ttft * 1e3, (tt[-1] - tt[0]) / max(1, len(tt) - 1) * 1e3

    def round(self, ctx: int) -> None:
        ttft, dec = self.generate(ctx)
        s = self.samples.setdefault(ctx, {"prefill_ms": [], "decode_ms": []})
        s["prefill_ms"].append(ttft)
        if self.n:
            s["decode_ms"].append(dec)
        print(f"  topg ctx {ctx}: TTFT {ttft:.0f} ms, decode {dec:.1f} ms/token", flush=True)

    def close(self) -> None:
        """Stop the engine and drop it (its samples stay): where the sides take turns,
        llama.cpp runs next and the weights must be gone by then."""
        self.eng.shutdown()
        del self.eng
        forget_engines()


class Llama:
    def __init__(
        self, bench: str, path: Path, fa: dict[str, str], decode_tokens: int, measure: list[str]
    ) -> None:
        self.bench, self.path, self.fa, self.n = bench, path, fa, decode_tokens
        self.measure = measure
        self.samples: dict[int, dict[str, dict[int, list[float]]]] = {}
        self.cmds: dict[str, str] = {}

    def _run(self, key: str, args: list[str], per: int, ctx: int) -> None:
        cmd = [self.bench, "-m", str(self.path), "-t", str(THREADS), "-r", "1", "-o", "json",
               "-fa", self.fa[key], *args]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-400:]}")
        s = self.samples.setdefault(ctx, {"prefill_ms": {}, "decode_ms": {}})
        for row in json.loads(p.stdout):
            fa = int(bool(row.get("flash_attn")))
            s[key].setdefault(fa, []).extend(x / 1e6 / per for x in row["samples_ns"])
            print(f"  llama.cpp ctx {ctx} fa {fa}: {key} {s[key][fa][-1]:.1f}", flush=True)
        self.cmds[f"{key} {ctx}"] = " ".join(cmd)

    def round(self, ctx: int) -> None:
        # llama-bench's warm-up of a prompt test runs the whole prompt once more: at 16k
        # tokens minutes, for a run whose first pass is compute-bound anyway
        warm = ["--no-warmup"] if ctx >= LONG else []
        if "prefill" in self.measure:
            self._run("prefill_ms", ["-p", str(ctx), "-n", "0", *warm], 1, ctx)
        if "decode" in self.measure:
            self._run("decode_ms", ["-p", "0", "-n", str(self.n), "-d", str(ctx)], self.n, ctx)


def run_format(fmt: str, path: Path, a: argparse.Namespace, bench: str) -> Iterator[dict]:
    """Per context, its row, as soon as it is measured (sides that fit in memory together;
    else every context's row once both sides have taken their turn)."""
    ctxs = [int(c) for c in a.contexts.split(",")]
    measure = a.measure.split(",")

    def make_topg() -> Topg:
        return Topg(path, fmt, max(ctxs) + a.decode_tokens + 16, a.decode_tokens, measure)

    fa = {"prefill_ms": a.llama_fa, "decode_ms": a.llama_fa_decode or a.llama_fa}
    llama = Llama(bench, path, fa, a.decode_tokens, measure)
    together = sides_fit([path.stat().st_size] * 2)  # 8B: each side holds the file's bytes
    if not together:
        print(f"[{a.shape} {fmt}] the sides do not fit in memory together: one at a time",
              flush=True)  # fmt: skip
    topg = make_topg()
    sides = [topg, llama] if together else [topg]
    try:
        for ctx in ctxs:  # the topg side runs first in even rounds, llama.cpp in odd ones
            for r in range(a.repeats):
                for side in sides[r % 2 :] + sides[: r % 2]:
                    side.round(ctx)
            if together:
                yield _row(a, fmt, ctx, topg, llama, "interleaved rounds")
    finally:
        topg.close()
    if not together:  # llama.cpp's turn, the engine gone
        for ctx in ctxs:
            for _ in range(a.repeats):
                llama.round(ctx)
            yield _row(a, fmt, ctx, topg, llama, "one side at a time (memory)")


def _row(a: argparse.Namespace, fmt: str, ctx: int, topg: Topg, llama: Llama, order: str) -> dict:
    figures: dict = {}
    ratios: dict = {}
    lc_fa: dict = {}
    for key in a.measure.split(","):
        t = summarize(topg.samples[ctx][key + "_ms"])
        per_fa = {fa: summarize(v) for fa, v in llama.samples[ctx][key + "_ms"].items()}
        fa = min(per_fa, key=lambda k: per_fa[k].median)
        figures[f"topg {key}"] = t.to_dict()
        figures[f"llama.cpp {key}"] = per_fa[fa].to_dict()
        ratios[f"{key} topg / llama.cpp"] = t.scaled(1 / per_fa[fa].median).to_dict()
        lc_fa[key] = {"best": fa, **{str(k): v.to_dict() for k, v in per_fa.items()}}
    row = {
        "key": f"{a.shape} | {fmt} | context {ctx}",
        "shape": a.shape, "format": fmt, "context": ctx,
        "unit": "ms (prefill), ms/token (decode)", "decode_tokens": a.decode_tokens,
        "figures": figures, "ratios": ratios, "llama_by_flash_attn": lc_fa, "order": order,
        "topg_load_s": topg.load_s, "llama_cmds": llama.cmds,
    }  # fmt: skip
    line = "; ".join(
        f"{key} topg {figures[f'topg {key}']['median']:.1f}, llama.cpp "
        f"{figures[f'llama.cpp {key}']['median']:.1f} "
        f"({ratios[f'{key} topg / llama.cpp']['median']:.2f}x)"
        for key in a.measure.split(",")
    )
    print(f"[{a.shape} {fmt} ctx {ctx}] {line} (prefill ms, decode ms/token)", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--formats", default="bf16,q4_k_m")
    ap.add_argument("--contexts", default="2048", help="prompt lengths, comma-separated")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--llama-fa", default="0,1", help="llama-bench -fa values (the best kept)")
    ap.add_argument(
        "--llama-fa-decode",
        default=None,
        help="llama-bench -fa values for the decode figures (default: --llama-fa)",
    )
    ap.add_argument("--measure", default="prefill,decode", help="prefill and / or decode")
    ap.add_argument("--keep", action="store_true", help="keep the quantised files")
    ap.add_argument("--out", default="bench_results")
    a = ap.parse_args(argv)
    if not a.measure or not set(a.measure.split(",")) <= {"prefill", "decode"}:
        ap.error(f"--measure: expected prefill and / or decode, got {a.measure!r}")
    machine()  # the records' machine, measured before the first model loads
    for fmt, path, llama in format_files(a.shape, a.formats, a.keep):
        for row in run_format(fmt, path, a, llama["llama-bench"]):
            save_rows("real_size_context", [row],
                      [f"{THREADS} threads each; random prompts, greedy, ignore_eos"], a.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
