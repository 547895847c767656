"""quantized.py's side-by-side with llama.cpp: the same GGUF file run by llama.cpp
(``llama-bench``) and by the engine (``quantization="gguf"``: its packed tensors as they
are), per format, in interleaved rounds in one process.

Files: the shipped SmolLM2 Q4_1 file, and Q8_0 / Q4_0 made from it by ``llama-quantize
--allow-requantize`` (de-quantised, then quantised again; cached beside the F32 / BF16
files of the other benchmarks).

Measured per format, as the engine benchmark measures batch 1:
* decode: a random 256-token prompt, 64 new tokens, greedy; (last token time - first
  token time) / 63, median of ``repeats`` prompts; llama.cpp ``-p 0 -n 64 -d 256``;
* prefill: time to the first token of a random 512-token prompt (engine: arrival to first
  token, sampling included); llama.cpp ``-p 512 -n 0``.

The engine runs each file twice: fp32 activations (the default) and
``int8_activations=True`` (activations rounded to int8 per block of 32 and integer dot
products, as llama.cpp computes).
"""

from __future__ import annotations

import random
from pathlib import Path

from engine_common import DECODE_CONTEXT, DECODE_TOKENS, MAX_MODEL_LEN, TTFT_PROMPT

from torch_topg.bench.timing import summarize, timed

#: Formats compared, in order: the shipped file first.
LLAMA_FORMATS = ("q4_1", "q8_0", "q4_0")
#: The K-quant files (llama-quantize's mixes; SmolLM2's 576-wide rows are not a multiple
#: of 256, so most of their tensors fall back to q5_0 / q5_1 / q8_0, packed formats here
#: too: every tensor runs as the file stores it), for perplexity.
K_FORMATS = ("q4_k_m", "q5_k_m", "q6_k")


def gguf_file(fmt: str, llama: dict) -> Path:
    from engine_llama import gguf_for

    from torch_topg.models.hf import gguf_path

    return Path(gguf_path()) if fmt == "q4_1" else gguf_for(fmt, llama["llama-quantize"])


def file_formats(path: Path) -> dict[str, int]:
    """Tensor count per storage type in a GGUF file (what llama-quantize produced)."""
    import gguf

    out: dict[str, int] = {}
    for t in gguf.GGUFReader(path).tensors:
        name = t.tensor_type.name.lower()
        out[name] = out.get(name, 0) + 1
    return out


class EngineSide:
    """The engine on one file (fp32 or int8 activations), loaded once and sampled one
    round at a time: each round one decode (a random 256-token prompt, 64 new tokens) and
    one TTFT (a random 512-token prompt). Both sides of a file draw the same prompts."""

    def __init__(self, path: Path, int8_activations: bool, *, quantization: str | None = "gguf",
                 dtype: str | None = None, ttft: bool = True) -> None:  # fmt: skip
        from torch_topg.engine import Engine

        q = {"method": quantization, "int8_activations": int8_activations} if quantization else None
        kw = {"dtype": dtype} if dtype else {}
        self.eng, self.load_s = timed(Engine.from_pretrained, str(path), quantization=q,
                                      max_batch_size=1, max_model_len=MAX_MODEL_LEN,
                                      prefix_caching=False, **kw)  # fmt: skip
        self.with_ttft = ttft
        self.rng = random.Random(0)
        self.kw = dict(temperature=0, ignore_eos=True)
        self.decode: list[float] = []
        self.ttft: list[float] = []
        self.eng.wait_warm()  # the warm-up's background compile (engine.md)
        self.eng.generate(self.ids(DECODE_CONTEXT), max_new_tokens=8, **self.kw)  # warm-up
        if ttft:
            self.eng.generate(self.ids(TTFT_PROMPT), max_new_tokens=1, **self.kw)

    def ids(self, n: int) -> list[int]:
        return [self.rng.randrange(10, 40000) for _ in range(n)]

    def round(self) -> None:
        o = self.eng.generate(self.ids(DECODE_CONTEXT), max_new_tokens=DECODE_TOKENS, **self.kw)
        tt = o[0].outputs[0].token_times
        self.decode.append((tt[-1] - tt[0]) / (len(tt) - 1) * 1e3)
        if not self.with_ttft:
            return
        o = self.eng.generate(self.ids(TTFT_PROMPT), max_new_tokens=1, **self.kw)
        self.ttft.append(o[0].ttft * 1e3)

    def close(self) -> dict:
        try:
            plan = self.eng.stats()["decode_plan"]
        finally:
            self.eng.shutdown()
        ttft = summarize(self.ttft) if self.ttft else None
        return {"decode_ms": summarize(self.decode), "prefill_ms": ttft,
                "load_s": self.load_s, "plan": plan}  # fmt: skip


class LlamaSide:
    """llama-bench on the same file, one decode and one prefill sample a round (each
    llama-bench call warms up first)."""

    def __init__(self, path: Path, llama: dict) -> None:
        self.path, self.bench = path, llama["llama-bench"]
        self.decode: list[float] = []
        self.ttft: list[float] = []
        self.last: dict = {}

    def round(self) -> None:
        from engine_llama import run_llama_bench

        self.last = run_llama_bench(self.bench, self.path, 1)
        self.decode.append(self.last["decode_ms"]["median"])
        self.ttft.append(self.last["ttft_ms"]["median"])

    def close(self) -> dict:
        d, t = summarize(self.decode), summarize(self.ttft)
        return {"decode_ms": d.median, "prefill_ms": t.median, "decode_range": [d.lo, d.hi],
                "prefill_range": [t.lo, t.hi], "decode_cmd": self.last["decode_ms_cmd"],
                "prefill_cmd": self.last["ttft_ms_cmd"], "build": self.last["build"]}  # fmt: skip


def side_by_side(llama: dict, repeats: int, formats=LLAMA_FORMATS) -> list[dict]:
    """Per format, `repeats` rounds; each round samples llama.cpp, the engine with fp32
    activations and the engine with int8 activations once, in an order rotated every
    round, so a change in the machine's speed during the run reaches all three."""
    rows = []
    for fmt in formats:
        path = gguf_file(fmt, llama)
        row = {"format": fmt, "file": path.name, "tensors": file_formats(path)}
        sides = {"llama": LlamaSide(path, llama), "topg": EngineSide(path, False),
                 "topg_a8": EngineSide(path, True)}  # fmt: skip
        names = list(sides)
        try:
            for r in range(repeats):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    sides[name].round()
        finally:
            for name, side in sides.items():
                row[name] = side.close()
        t, a8, lc = row["topg"], row["topg_a8"], row["llama"]
        print(f"{fmt}: decode topg {t['decode_ms'].median:.2f} (int8 act "
              f"{a8['decode_ms'].median:.2f}) / llama.cpp {lc['decode_ms']:.2f} ms; prefill "
              f"512 topg {t['prefill_ms'].median:.0f} / llama.cpp {lc['prefill_ms']:.0f} ms",
              flush=True)  # fmt: skip
        rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| format (file tensors) | activations | decode ms/token topg | llama.cpp | "
        "topg / llama.cpp | prefill 512 ms topg | llama.cpp | topg / llama.cpp |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lc = r["llama"]
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["tensors"].items()))
        for key, act in (("topg", "fp32"), ("topg_a8", "int8")):
            t = r[key]
            lines.append(
                f"| {r['format']} ({kinds}) | {act} | {t['decode_ms'].fmt()} | "
                f"{lc['decode_ms']:.2f} | {t['decode_ms'].median / lc['decode_ms']:.2f}x | "
                f"{t['prefill_ms'].fmt('.0f')} | {lc['prefill_ms']:.0f} | "
                f"{t['prefill_ms'].median / lc['prefill_ms']:.2f}x |"
            )
    if rows:
        lines.append(f"\nllama.cpp: `{rows[0]['llama']['decode_cmd']}` and "
                     f"`{rows[0]['llama']['prefill_cmd']}` (build {rows[0]['llama']['build']})")  # fmt: skip
    return "\n".join(lines)


# --- perplexity on identical token ids ---------------------------------------------------
# llama-perplexity -c 512 tokenizes the text itself (its tokenizer and transformers' split
# a text differently: 3,768 against 3,823 ids for Python's LICENSE.txt), so the engine side reads llama.cpp's
# ids (llama-tokenize, same model file) and scores them as perplexity.cpp does: chunks of
# 512, the logits of positions 256..510 each predicting the next id (255 a chunk), no BOS
# (SmolLM2's file does not add one).
PPL_CTX = 512


def llama_ids(llama: dict, path: Path, text: Path) -> list[int]:
    import ast
    import subprocess

    cmd = [str(llama["llama-tokenize"]), "-m", str(path), "-f", str(text), "--ids", "--log-disable"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    return list(ast.literal_eval(out.strip()))


def llama_ppl(llama: dict, path: Path, text: Path, chunks: int) -> tuple[float, str]:
    import re
    import shlex
    import subprocess

    cmd = [str(llama["llama-perplexity"]), "-m", str(path), "-f", str(text), "-c", str(PPL_CTX),
           "-t", "2", "--chunks", str(chunks)]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", p.stdout + p.stderr)
    if p.returncode != 0 or m is None:
        raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}: {p.stderr[-400:]}")
    return float(m.group(1)), shlex.join(cmd)


def topg_ppl(model, ids: list[int], chunks: int) -> float:
    import math

    import torch

    first, nll, count = PPL_CTX // 2, 0.0, 0
    with torch.inference_mode():
        for i in range(chunks):
            row = torch.tensor(ids[i * PPL_CTX : (i + 1) * PPL_CTX])
            logits = model(row[None]).logits[0, first : PPL_CTX - 1].float()
            lp = torch.log_softmax(logits, -1)
            nll -= lp.gather(-1, row[first + 1 :, None]).sum().item()
            count += PPL_CTX - 1 - first
    return math.exp(nll / count)


#: Perplexity files: the float files (the shipped weights de-quantised by llama-quantize;
#: the engine runs them in fp32 / bf16) and the quantised ones.
PPL_FORMATS = ("fp32", "bf16", *LLAMA_FORMATS, *K_FORMATS)


def perplexities(llama: dict, text: Path, chunks: int, formats=PPL_FORMATS) -> list[dict]:
    """Per GGUF file: llama-perplexity, and the engine's model loaded from the same file
    on llama.cpp's token ids: a float file in its own dtype; a quantised one packed, with
    fp32 activations, then int8."""
    import torch

    from torch_topg.engine.loading import load_gguf_packed

    rows = []
    for fmt in formats:
        path = gguf_file(fmt, llama)
        ids = llama_ids(llama, path, text)
        n = min(chunks, len(ids) // PPL_CTX)
        ref, cmd = llama_ppl(llama, path, text, n)
        row = {"format": fmt, "chunks": n, "llama": ref, "llama_cmd": cmd, "int8": None}
        dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
        for act in (False, True) if fmt in (*LLAMA_FORMATS, *K_FORMATS) else (False,):
            q = {"method": "gguf", "int8_activations": act}
            model = load_gguf_packed(path, dtype, q)[0]
            row["int8" if act else "fp32"] = topg_ppl(model, ids, n)
        line = f"{fmt}: perplexity llama.cpp {ref:.4f}, topg {row['fp32']:.4f} ({_vs(row, 'fp32')})"
        if row["int8"] is not None:
            line += f", int8 activations {row['int8']:.4f} ({_vs(row, 'int8')})"
        print(line, flush=True)
        rows.append(row)
    return rows


def _vs(row: dict, key: str) -> str:
    return "" if row[key] is None else f"{100 * (row[key] / row['llama'] - 1):+.2f}%"


def ppl_table(rows: list[dict]) -> str:
    lines = ["| file | chunks of 512 | llama-perplexity | topg (fp32 activations; bf16 file: bf16) | vs llama.cpp | "
             "topg (int8 activations) | vs llama.cpp |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        a8 = "" if r["int8"] is None else f"{r['int8']:.4f}"
        lines.append(
            f"| {r['format']} | {r['chunks']} | {r['llama']:.4f} | {r['fp32']:.4f} | "
            f"{_vs(r, 'fp32')} | {a8} | {_vs(r, 'int8')} |"
        )
    if rows:
        lines.append(f"\nllama.cpp: `{rows[0]['llama_cmd']}`")
    return "\n".join(lines)
