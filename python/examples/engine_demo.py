"""``make demo``: the torch_topg engine serving SmolLM2-135M-Instruct (real weights, the
embedded default) on this machine.

1. streams an answer to one chat prompt as it is generated;
2. serves 8 concurrent chat requests with continuous batching and prints total output
   tokens/s, time to first token per request, and the batch sizes the engine ran;
3. sends a second turn of the first conversation (the whole history, as chat clients
   do): its prompt is read from the prefix cache, not recomputed;
4. runs the shipped GGUF file's Q4_1 weights as they are (``quantization="gguf"``: packed,
   no float copy) on the same prompt, beside the float engine's single stream.

    python python/examples/engine_demo.py [--dtype bfloat16] [--tokens 64] [--no-compile]
        [--no-gguf]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from torch_topg import Engine

PROMPT = "What is the capital of France, and what is it famous for?"
QUESTIONS = [
    "Give me three tips for writing clean Python code.",
    "What causes the seasons on Earth?",
    "Explain what a hash table is.",
    "Write a short poem about autumn.",
    "How does a refrigerator keep food cold?",
    "What is the difference between a list and a tuple in Python?",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument("--no-gguf", action="store_true", help="skip the quantised part")
    args = p.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(
        dtype=args.dtype, max_batch_size=8, max_model_len=1024, compile=not args.no_compile
    )
    st = engine.stats()
    print(
        f"engine ready in {time.perf_counter() - t0:.1f} s (SmolLM2-135M-Instruct, {args.dtype}, "
        f"{torch.get_num_threads()} threads; {st['compile']['compilations']} graphs compiled, "
        f"KV pool {st['kv']['blocks_total']} blocks x {st['kv']['block_size']} tokens = "
        f"{st['kv']['bytes'] / 2**20:.0f} MiB)\n"
    )
    with engine:
        print(f"> {PROMPT}")
        t0 = time.perf_counter()
        n = 0
        answer = ""
        float_rate = 0.0
        for delta in engine.submit(
            [{"role": "user", "content": PROMPT}], max_new_tokens=args.tokens, temperature=0,
            session_id="demo",
        ):  # fmt: skip
            print(delta.text, end="", flush=True)
            answer += delta.text
            n += len(delta.token_ids)
        dt = time.perf_counter() - t0
        float_rate = n / dt
        print(f"\n[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, one stream]\n")

        print(f"8 concurrent requests, {args.tokens} new tokens each (greedy):")
        before = dict(engine.stats()["steps"]["batch_sizes"])
        t0 = time.perf_counter()
        handles = [
            engine.submit(
                [{"role": "user", "content": q}],
                max_new_tokens=args.tokens,
                temperature=0,
                ignore_eos=True,
            )
            for q in QUESTIONS
        ]
        outs = [h.result() for h in handles]
        dt = time.perf_counter() - t0
        total = sum(o.completion_tokens for o in outs)
        ttft = [o.ttft * 1e3 for o in outs]
        after = engine.stats()["steps"]["batch_sizes"]
        sizes = {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
        for q, o in zip(QUESTIONS, outs, strict=True):
            print(f"  {q[:44]:<46} TTFT {o.ttft * 1e3:6.0f} ms  {o.text[:60]!r}...")
        print(
            f"\n{total} tokens in {dt:.2f} s: {total / dt:.1f} tokens/s in total "
            f"(TTFT median {statistics.median(ttft):.0f} ms, max {max(ttft):.0f} ms)"
        )
        print(f"batch sizes run (size: steps): {dict(sorted(sizes.items()))}")
        print(f"compilations while serving: {engine.stats()['compile']['while_serving']}")

        follow = "Name two museums there."
        chat = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": answer},
                {"role": "user", "content": follow}]  # fmt: skip
        print(f"\nsecond turn, the whole history re-sent:\n> {follow}")
        out = engine.generate(chat, max_new_tokens=args.tokens, temperature=0, session_id="demo")[0]
        print(out.text)
        kv = engine.stats()["kv"]
        print(
            f"[TTFT {out.ttft * 1e3:.0f} ms: {out.cached_prompt_tokens} of "
            f"{out.prompt_tokens} prompt tokens from the prefix cache; engine hit rate "
            f"{kv['hit_rate']:.0%} of {kv['query_tokens']} looked-up tokens]"
        )
    if not args.no_gguf:
        quantised(args, float_rate)


def quantised(args: argparse.Namespace, float_rate: float) -> None:
    """The shipped Q4_1 GGUF file run packed (docs/quantization.md)."""
    t0 = time.perf_counter()
    with Engine.from_pretrained(quantization="gguf", dtype=args.dtype, max_batch_size=1,
                                max_model_len=1024, compile=not args.no_compile) as q:  # fmt: skip
        head = q.model.model.layers[0].mlp.gate_proj
        print(f"\nquantization='gguf': the Q4_1 file's packed weights ({type(head).__name__}, "
              f"format {head.format}), ready in {time.perf_counter() - t0:.1f} s; "
              f"decode plan: {q.stats()['decode_plan']['active']}")  # fmt: skip
        print(f"> {PROMPT}")
        t0, n = time.perf_counter(), 0
        for delta in q.submit([{"role": "user", "content": PROMPT}], max_new_tokens=args.tokens,
                              temperature=0):  # fmt: skip
            print(delta.text, end="", flush=True)
            n += len(delta.token_ids)
        dt = time.perf_counter() - t0
        print(f"\n[{n} tokens in {dt:.2f} s: {n / dt:.1f} tokens/s, one stream; "
              f"{args.dtype} weights above: {float_rate:.1f} tokens/s]")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
