"""Weight-only quantisation on SmolLM2-135M: perplexity per format, and decode ms/token.

Perplexity: a fixed English text (``tests/data/coriolanus.txt``: the opening of
Shakespeare's *Coriolanus*, public domain; tests/data/README.md) in chunks of 512 tokens; like ``llama-perplexity -c 512`` only the second
half of each chunk is scored (each scored token sees at least 256 tokens of context).
Formats: the float model (the shipped Q4_1 file de-quantised: its weights *are* q4_1,
so ``gguf`` gives the same numbers through the reference), and the float weights
quantised again with ``torch_topg.quantize`` (q8_0, int8, int4 in groups of 32 / 64 /
128; a second quantisation of weights that already sit on a q4_1 grid).

Decode: ``Engine.from_pretrained(quantization=...)``, greedy, ms per output token after
the first, 2 threads.

Against llama.cpp (``--llama``, quantized_llama.py): the same GGUF files (Q4_1 as shipped,
Q8_0 and Q4_0 made from it by llama-quantize), decode at context 256 and prefill of 512
tokens, llama-bench then the engine per format; a record in ``--out`` and a table in
``--md``.

    python python/benchmarks/quantized.py [--chunks 2] [--decode] [--llama [--repeats 5]]
        [--out bench_results] [--md bench_results/quantized.md]   (--chunks 0: no perplexity)
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

import torch_topg
from torch_topg.bench import timed
from torch_topg.models import load_smollm2

FORMATS = [None, "q8_0", "int8", "int4_g32", "int4_g64", "int4_g128"]
#: The accuracy bound of the engine's default for GGUF files against llama-perplexity.
PPL_BOUND = 0.005


def eval_text() -> Path:
    """The fixed perplexity text shipped in tests/data (public domain; its README says where
    it comes from)."""
    return Path(__file__).resolve().parents[2] / "tests" / "data" / "coriolanus.txt"


def text_ids(tok, chunks: int, ctx: int = 512) -> torch.Tensor:
    text = eval_text().read_text()
    ids = tok(text, return_tensors="pt").input_ids[0]
    n = min(chunks, len(ids) // ctx)
    return ids[: n * ctx].view(n, ctx)


def perplexity(model, ids: torch.Tensor) -> float:
    nll, count = 0.0, 0
    half = ids.shape[1] // 2
    with torch.inference_mode():
        for row in ids:
            logits = model(row[None]).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1)
            tgt = row[1:]
            picked = lp.gather(-1, tgt[:, None])[:, 0][half - 1 :]
            nll -= picked.sum().item()
            count += picked.numel()
    return math.exp(nll / count)


def decode_ms(quantization: str | None, tokens: int = 64) -> float:
    from torch_topg.engine import Engine

    with Engine.from_pretrained(quantization=quantization, seed=0) as eng:
        eng.wait_warm()  # the warm-up's background compile (engine.md)
        prompt = [{"role": "user", "content": "Tell me about the history of Paris."}]
        eng.generate(prompt, max_new_tokens=4, temperature=0)  # warm-up
        out, s = timed(eng.generate, prompt, max_new_tokens=tokens, temperature=0,
                       ignore_eos=True)  # fmt: skip
        return s * 1e3 / len(out[0].token_ids)


def vs_llama(args) -> None:
    from llama_cpp_build import ensure_llama_cpp
    from quantized_llama import side_by_side, table

    from torch_topg.bench.machine import machine_info, read_bandwidth_stats
    from torch_topg.bench.record import new_record, validate, write_record
    from torch_topg.bench.timing import Stats

    torch.set_num_threads(2)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    bw = read_bandwidth_stats()
    llama = ensure_llama_cpp()
    ppl = []
    if args.llama_ppl:
        from quantized_llama import PPL_FORMATS, perplexities, ppl_table

        formats = args.ppl_formats.split(",") if args.ppl_formats else PPL_FORMATS
        ppl = perplexities(llama, eval_text(), args.llama_ppl, formats)
    rows = side_by_side(llama, args.repeats) if args.llama else []
    notes = [f"- command: `python python/benchmarks/quantized.py {' '.join(sys.argv[1:])}`",
             f"- date {date}; 2 threads; SmolLM2-135M-Instruct; read bandwidth "
             f"{bw.median / 1e9:.1f} GB/s"
             + (f"; per format {args.repeats} interleaved rounds of llama-bench, the engine "
                "(fp32 act.), the engine (int8 act.), the order rotated each round"
                if rows else "")]  # fmt: skip
    text = (table(rows) + "\n\n" if rows else "") + (ppl_table(ppl) + "\n\n" if ppl else "")
    text += "\n".join(notes)
    rec_rows = [{"key": {"format": r["format"]},
                 "figures": {k: v.to_dict() for k, v in r["topg"].items() if isinstance(v, Stats)},
                 "extra": {"llama": r["llama"], "file": r["file"], "tensors": r["tensors"],
                           "load_s": r["topg"]["load_s"], "plan": r["topg"]["plan"],
                           "int8_activations": {k: (v.to_dict() if isinstance(v, Stats) else v)
                                                for k, v in r["topg_a8"].items()}}}
                for r in rows]  # fmt: skip
    rec_rows += [{"key": {"format": r["format"], "measure": "perplexity"},
                  "figures": {}, "extra": r} for r in ppl]  # fmt: skip
    rec = new_record("quantized", rec_rows, machine_info(measure=False), notes=notes, date=date)
    path = write_record(validate(rec), args.out)
    print("\n" + text + f"\nrecord: {path}")
    if args.md:
        Path(args.md).write_text(text + "\n")
    # the accuracy guard of quantization="gguf"'s default (int8 activations):
    # within 0.5% of llama-perplexity on the same file (docs/quantization.md)
    off = [r["format"] for r in ppl if r["int8"] is not None
           and abs(r["int8"] / r["llama"] - 1) > PPL_BOUND]  # fmt: skip
    if off:
        sys.exit(f"int8-activation perplexity more than {PPL_BOUND:.1%} from llama.cpp's: {off}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--decode", action="store_true")
    ap.add_argument("--llama", action="store_true", help="decode / prefill against llama.cpp")
    ap.add_argument("--llama-ppl", type=int, default=0, metavar="CHUNKS",
                    help="perplexity against llama-perplexity on CHUNKS chunks of 512")  # fmt: skip
    ap.add_argument("--ppl-formats", default="", help="comma-separated (default: all)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    if args.llama or args.llama_ppl:
        vs_llama(args)
    if not args.chunks and not args.decode:
        return
    warnings.simplefilter("ignore", RuntimeWarning)  # the reference fallback's notice
    torch.set_num_threads(2)
    base, tok = load_smollm2(torch.float32)
    ids = text_ids(tok, args.chunks)
    print(f"text: {ids.numel()} tokens in {ids.shape[0]} chunks of {ids.shape[1]}")
    ref = None
    for fmt in FORMATS if args.chunks else []:
        model = base if fmt is None else torch_topg.quantize(copy.deepcopy(base), fmt)
        ppl, s = timed(perplexity, model, ids)
        ref = ppl if ref is None else ref
        name = fmt or "fp32 (= q4_1 file)"
        print(f"{name:20s} ppl {ppl:8.4f}  {100 * (ppl / ref - 1):+6.2f}%  "
              f"({s:.1f} s)")  # fmt: skip
    if args.decode:
        for q in (None, "gguf", "int8", "int4"):
            print(f"decode {q or 'fp32'}: {decode_ms(q):.1f} ms/token")


if __name__ == "__main__":
    main()
