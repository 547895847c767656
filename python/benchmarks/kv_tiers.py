"""The KV cache hierarchy on SmolLM2 (real weights): what prefix reuse, the disk tier and
session-aware eviction do to time to first token.

1. **Shared system prompt** (~1,000 tokens): the TTFT of a request that hits the cached
   system prompt against the TTFT of a cold request made of only its uncached suffix
   (target: at most 1.2x, reuse costs almost nothing). Alternated, a new question each
   time (16 of them), so neither side finds its own suffix cached.
2. **Multi-turn chat**: 24 conversations x 6 turns, turns arriving interleaved (each round
   every conversation sends its next turn, in a shuffled order, 4 clients at a time),
   the whole history re-sent each turn (as OpenAI clients do). The device KV pool holds
   about a quarter of the conversations' combined history, the same in every
   configuration: no prefix caching; prefix caching with LRU in memory; + a disk tier;
   + session-aware eviction (``session_id`` = the conversation). Mean and p90 TTFT of
   turns 2-6 and the prefix hit rate (target: session-aware with the disk tier at least
   2x lower mean TTFT than LRU in memory, and lower than the disk tier with LRU).

    .venv/bin/python python/benchmarks/kv_tiers.py [--quick] [--dtype fp32]

Writes ``bench_results/kv_tiers-<date>-<commit>.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_topg.bench import Stats, Stopwatch, new_record, write_record
from torch_topg.bench.machine import machine_info
from torch_topg.bench.timing import summarize
from torch_topg.engine import Engine
from torch_topg.engine.model_runner import ModelRunner

HERE = Path(__file__).resolve().parent
TOPICS = [
    "a lighthouse keeper", "a bakery", "the history of tea", "volcanoes", "a chess club",
    "bicycle repair", "the moon landing", "honeybees", "a city library", "sailing",
    "a jazz trio", "glaciers", "a vegetable garden", "trains in Switzerland", "owls",
    "a robot that paints", "the printing press", "coral reefs", "a mountain hut",
    "origami", "a night market", "the postal service", "deserts", "a violin maker",
]  # fmt: skip
FOLLOW_UPS = [
    "Tell me more about the most surprising detail you mentioned.",
    "Now explain it to a ten-year-old, with one example from everyday life.",
    "What would change if this happened two hundred years ago instead?",
    "List three questions a curious visitor might ask, and answer the first one.",
    "Summarise our whole conversation in four sentences, keeping the key facts.",
]


def system_prompt(approx_tokens: int) -> str:
    """A long operator prompt of numbered rules (~12 tokens a rule)."""
    rules = [
        f"Rule {i}: when the user mentions topic number {i}, answer politely, cite the "
        f"relevant section, and keep the reply under {50 + i} words."
        for i in range(1, approx_tokens // 30 + 2)
    ]
    return "You are the help desk assistant of a museum. " + " ".join(rules)


def encode(tok, messages: list[dict]) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def ttft(eng: Engine, ids: list[int], **kw) -> tuple[float, int]:
    """Seconds to the first token of one request, and its cached prompt tokens."""
    sw = Stopwatch()
    with sw.lap():
        h = eng.submit(ids, max_new_tokens=1, temperature=0.0, **kw)
        next(iter(h))
    return sw.last, h.result().cached_prompt_tokens


# --- 1. the shared system prompt ----------------------------------------------------------
def shared_prompt(dtype: str, reps: int, compile: bool) -> dict:
    from engine_common import QUESTIONS

    eng = Engine.from_pretrained(dtype=dtype, compile=compile, max_model_len=2048)
    eng.wait_warm()  # the warm-up's background compile (engine.md)
    tok = eng.tokenizer
    sys_text = system_prompt(1000)
    warm = encode(tok, [{"role": "system", "content": sys_text}, {"role": "user", "content": "Hi"}])
    eng.generate(warm, max_new_tokens=1)  # caches the system prompt
    hit_s, cold_s, cached, suffix = [], [], [], []
    for q in QUESTIONS[:reps]:
        ids = encode(tok, [{"role": "system", "content": sys_text}, {"role": "user", "content": q}])
        bs = eng.pool.block_size
        common = next(i for i, (a, b) in enumerate(zip(ids, warm, strict=False)) if a != b)
        n = common // bs * bs
        dt_cold, c0 = ttft(eng, ids[n:])  # only the suffix, from nothing
        dt_hit, c1 = ttft(eng, ids)
        assert c0 == 0, c0
        hit_s.append(dt_hit)
        cold_s.append(dt_cold)
        cached.append(c1)
        suffix.append(len(ids) - n)
    eng.shutdown()
    ratio = [h / c for h, c in zip(hit_s, cold_s, strict=True)]
    return {
        "prompt_tokens": len(warm),
        "cached_tokens": statistics.median(cached),
        "suffix_tokens": statistics.median(suffix),
        "ttft_hit": summarize(hit_s),
        "ttft_suffix_cold": summarize(cold_s),
        "ratio": summarize(ratio),
    }


# --- 2. multi-turn chat -------------------------------------------------------------------
CONFIGS = {
    "no prefix caching": dict(prefix_caching=False),
    "LRU in memory": dict(),
    "+ disk tier": dict(disk=True),
    "+ session-aware": dict(disk=True, sessions=True),
}


def conversation_opening(c: int) -> str:
    topic = TOPICS[c % len(TOPICS)]
    return (
        f"I am preparing a short talk about {topic} for a community evening. Give me an "
        f"overview of {topic}: where it comes from, what makes it interesting, and one "
        f"fact that most people do not know. Keep it concrete."
    )


def multi_turn(dtype: str, convs: int, turns: int, new_tokens: int, compile: bool) -> dict:
    # Size the pool from a dry count: a quarter of the combined history at the last turn.
    probe = Engine.from_pretrained(dtype=dtype, compile=False, kv_cache_memory=1 << 24)
    tok = probe.tokenizer
    per_block = ModelRunner.bytes_per_block(
        probe.model.config, probe.pool.block_size, probe.runner.dtype
    )
    probe.shutdown()
    opening = [
        encode(tok, [{"role": "user", "content": conversation_opening(c)}]) for c in range(convs)
    ]
    per_turn = statistics.mean(len(o) for o in opening) + new_tokens + 10
    history = convs * turns * per_turn
    # ... but never less than the running batch needs (4 clients at the longest
    # conversation, with room to spare): a pool that preempts measures preemption.
    budget_blocks = max(int(history / 4 / 16), int(1.5 * 4 * turns * per_turn / 16))
    out = {"history_tokens": int(history), "pool_blocks": budget_blocks, "configs": {}}
    for name, cfg in CONFIGS.items():
        tmp = tempfile.TemporaryDirectory(prefix="topg-kv-bench-") if cfg.get("disk") else None
        kw = dict(prefix_caching=cfg.get("prefix_caching", True))
        if tmp is not None:
            kw.update(disk_kv_path=tmp.name, disk_kv_memory=int(2 * history * per_block / 16))
        eng = Engine.from_pretrained(
            dtype=dtype, compile=compile, kv_cache_memory=budget_blocks * per_block,
            max_batch_size=4, max_model_len=2048, seed=0, **kw,
        )  # fmt: skip
        res = run_conversations(eng, convs, turns, new_tokens, sessions=cfg.get("sessions", False))
        res["kv"] = {k: v for k, v in eng.stats()["kv"].items() if k != "sessions"}
        eng.shutdown()
        if tmp is not None:
            tmp.cleanup()
        out["configs"][name] = res
        print(f"  {name:20s} mean TTFT {res['ttft_mean'] * 1e3:7.1f} ms, p90 "
              f"{res['ttft_p90'] * 1e3:7.1f} ms, hit rate {res['hit_rate']:.2f}", flush=True)  # fmt: skip
    return out


def run_conversations(eng: Engine, convs: int, turns: int, new_tokens: int, sessions: bool) -> dict:
    tok = eng.tokenizer
    hist = [[{"role": "user", "content": conversation_opening(c)}] for c in range(convs)]
    rng = random.Random(0)
    ttfts: list[float] = []
    prompt_tokens = cached_tokens = 0
    lock = threading.Lock()
    for t in range(turns):
        order = list(range(convs))
        rng.shuffle(order)

        def client() -> None:
            nonlocal prompt_tokens, cached_tokens
            while True:
                with lock:
                    if not order:
                        return
                    c = order.pop()
                ids = encode(tok, hist[c])
                sw = Stopwatch()
                with sw.lap():
                    h = eng.submit(ids, max_new_tokens=new_tokens, temperature=0.0,
                                   ignore_eos=True,
                                   session_id=f"conv-{c}" if sessions else None)  # fmt: skip
                    next(iter(h))
                first = sw.last
                res = h.result()
                with lock:
                    if t > 0:
                        ttfts.append(first)
                        prompt_tokens += len(ids)
                        cached_tokens += res.cached_prompt_tokens
                hist[c].append({"role": "assistant", "content": res.outputs[0].text})
                hist[c].append({"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]})

        threads = [threading.Thread(target=client) for _ in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    ttfts.sort()
    return {
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "ttft": summarize(ttfts),
        "hit_rate": cached_tokens / prompt_tokens,
        "turns_measured": len(ttfts),
    }


def _one(x: float) -> dict:
    return Stats(x, x, x, 1, "min-max").to_dict()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--quick", action="store_true", help="6 conversations x 3 turns, 4 reps")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", default="bench_results")
    a = ap.parse_args()
    torch.set_num_threads(2)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    compile = not a.no_compile
    convs, turns, reps = (6, 3, 4) if a.quick else (24, 6, 16)
    t0 = time.perf_counter()
    print("1. shared system prompt", flush=True)
    sp = shared_prompt(dtype, reps, compile)
    print(f"  hit {sp['ttft_hit'].fmt('.3f', ' s')} vs cold suffix "
          f"{sp['ttft_suffix_cold'].fmt('.3f', ' s')}: {sp['ratio'].fmt('.2f', 'x')} "
          f"({sp['cached_tokens']} of {sp['prompt_tokens']} tokens cached)", flush=True)  # fmt: skip
    print(f"2. multi-turn chat: {convs} conversations x {turns} turns", flush=True)
    mt = multi_turn(dtype, convs, turns, 32, compile)
    cfgs = mt["configs"]
    lru = cfgs["LRU in memory"]["ttft_mean"]
    rows = [
        {
            "key": f"shared system prompt | {sp['prompt_tokens']} tokens | {a.dtype}",
            "unit": "s",
            "figures": {
                "hit": sp["ttft_hit"].to_dict(),
                "cold suffix": sp["ttft_suffix_cold"].to_dict(),
            },
            "ratios": {"hit / cold suffix": sp["ratio"].to_dict()},
            "target": "hit / cold suffix <= 1.2",
            "verdict": "met" if sp["ratio"].median <= 1.2 else "missed",
        }
    ]
    for name, r in cfgs.items():
        rows.append({
            "key": f"multi-turn | {name} | {a.dtype}",
            "unit": "s",
            "figures": {"ttft": r["ttft"].to_dict()},
            "ratios": {"LRU in memory / this (mean)": _one(lru / r["ttft_mean"])},
            "ttft_mean": r["ttft_mean"], "ttft_p90": r["ttft_p90"], "hit_rate": r["hit_rate"],
            "kv": r["kv"],
        })  # fmt: skip
    sess, disk = cfgs["+ session-aware"]["ttft_mean"], cfgs["+ disk tier"]["ttft_mean"]
    verdict = "met" if lru / sess >= 2 and sess < disk else "missed"
    notes = [
        f"multi-turn: {convs} x {turns}, 32 new tokens a turn, 4 clients, device pool "
        f"{mt['pool_blocks']} blocks (~1/4 of {mt['history_tokens']} history tokens); "
        f"session-aware + disk vs LRU in memory {lru / sess:.2f}x lower mean TTFT, vs disk "
        f"+ LRU {disk / sess:.2f}x: {verdict} (target >= 2x and > 1x)",
        f"took {time.perf_counter() - t0:.0f} s",
    ]
    rec = new_record("kv_tiers", rows, machine_info(measure=False), quick=a.quick, notes=notes)
    path = write_record(rec, a.out)
    print()
    print("| case | mean TTFT | p90 TTFT | hit rate | vs LRU in memory |")
    print("|---|---|---|---|---|")
    for name, r in cfgs.items():
        print(f"| {name} | {r['ttft_mean'] * 1e3:.0f} ms | {r['ttft_p90'] * 1e3:.0f} ms | "
              f"{r['hit_rate']:.2f} | {lru / r['ttft_mean']:.2f}x |")  # fmt: skip
    print(f"\nshared system prompt: hit / cold suffix {sp['ratio'].fmt('.2f', 'x')}")
    print("\n".join(notes))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
