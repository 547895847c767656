"""Decode-step benchmark: the engine's decode step as one native call (``topg.DecodePlan``,
docs/decode-step.md) against the compiled graph it replaces and against llama.cpp, with
the read-bandwidth limit measured in the same run. One process, 2 threads, SmolLM2-135M-
Instruct real weights, context 256.

Measured per dtype (fp32, bf16), in this order, so that every comparison is side by side:

1. engine batch-1 decode ms/token: a 256-token random prompt, 64 new tokens, greedy,
   (last token time - first token time) / 63; each round runs an engine with the plan
   (the default), one with ``decode_plan=False`` (the compiled graph) and llama.cpp
   (``llama-bench -p 0 -n 64 -d 256 -r 1`` on the same weights: SmolLM2's GGUF converted
   to F32 / BF16, built natively from llama-cpp-python's vendored sources) in turn, so a
   slow period of the machine falls on all three; engine / llama.cpp is also given per
   round (the median of the rounds' ratios); each round also runs
   ``llama-batched-bench -pps -npp 256 -ntg 64 -npl 1,8``: llama.cpp's own decode step of
   1 and of 8 sequences at the same context, its batch 8 / batch 1;
2. the step alone at context 256 (the runner, no scheduler or sampler): plan and graph at
   batch 1 and batch 8, interleaved rounds (``torch_topg.bench.timing.compare``), beside
   llama.cpp's batch-8 / batch-1 step from step 1;
3. where the time goes: the plan's phases (``TOPG_PROFILE=1``, its own timers) and the
   graph's ops (``torch.profiler``), per step at batch 1;
4. plain transformers through the backend: ``torch.compile(model.forward, backend="topg")``
   and ``generate(cache_implementation="static")``, 64 new tokens after the same 256-token
   prompt, ms/token from a streamer's clock (first to last new token); each round runs
   the default (the decode graph on the plan, ``static_plan.py``),
   ``options={"decode_plan": False}`` (the compiled graph) and llama.cpp again, in turn.

The limit: bytes a batch-1 step must read (every weight once, the tied embedding once,
plus K and V of 256 tokens) over the read bandwidth probed before and after.

    python python/benchmarks/decode_step.py [--dtype fp32,bf16] [--repeats 5]
        [--out bench_results] [--md bench_results/decode_step.md] [--no-llama]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TOPG_PROFILE", "1")  # the plan reads it when it is built

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from engine_common import DECODE_CONTEXT, DECODE_TOKENS, THREADS  # noqa: E402

from torch_topg.bench.machine import machine_info, read_bandwidth_stats, remeasure  # noqa: E402
from torch_topg.bench.models import decode_read_bytes as read_bytes_per_step  # noqa: E402
from torch_topg.bench.record import new_record, validate, write_record  # noqa: E402
from torch_topg.bench.timing import Budget, Stats, compare, summarize  # noqa: E402

# Targets (issue: one native call per decode step).
TARGET_VS_LLAMA = {"fp32": 1.0, "bf16": 0.9}
TARGET_OF_LIMIT_FP32 = 0.8
TARGET_B8_OVER_B1 = 1.6
TARGET_BACKEND_VS_LLAMA = 1.15
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _engine(dtype: str, plan: bool):
    from torch_topg.engine import Engine

    eng = Engine.from_pretrained(None, dtype=dtype, max_batch_size=8, max_model_len=1024,
                                 prefix_caching=False, decode_plan=plan)  # fmt: skip
    eng.wait_warm()  # the warm-up's background compile (engine.md)
    return eng


def engine_decode_ms(eng, rng: random.Random) -> float:
    ids = [rng.randrange(10, 40000) for _ in range(DECODE_CONTEXT)]
    out = eng.generate(ids, max_new_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)[0]
    tt = out.outputs[0].token_times
    return (tt[-1] - tt[0]) / (len(tt) - 1) * 1e3


class _Clock:
    """A transformers streamer that keeps the time of each ``put`` (the prompt, then each
    new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_static_ms(model, ids: torch.Tensor) -> float:
    clock = _Clock()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=DECODE_TOKENS,
                       min_new_tokens=DECODE_TOKENS, do_sample=False, pad_token_id=0,
                       cache_implementation="static", streamer=clock)  # fmt: skip
    t = clock.times[1:]  # the new tokens
    return (t[-1] - t[0]) / (len(t) - 1) * 1e3


def by_round(ours: list[float], theirs: list[float]) -> Stats:
    """Our time over theirs, round by round (each pair measured minutes apart at most)."""
    return summarize([a / b for a, b in zip(ours, theirs, strict=True)])


def backend_static(dtype: str, repeats: int, llama_run=None) -> dict:  # type: ignore[no-untyped-def]
    """transformers ``generate(cache_implementation="static")`` on ``backend="topg"``, with
    the decode graph on the plan and (``decode_plan=False``) on the compiled graph; each
    round also runs ``llama_run`` (one llama-bench round) when given."""
    import copy

    from torch_topg.compile import REPORTS, clear_reports
    from torch_topg.models.hf import load_smollm2

    base, _ = load_smollm2(DTYPES[dtype])
    models = {}
    for name, on in (("plan", True), ("graph", False)):
        m = copy.deepcopy(base)
        m.forward = torch.compile(m.forward, backend="topg", options={"decode_plan": on})
        models[name] = m
    del base
    rng = random.Random(7)
    ids = torch.tensor([[rng.randrange(10, 40000) for _ in range(DECODE_CONTEXT)]])
    clear_reports()
    for m in models.values():
        hf_static_ms(m, ids)  # compiles the prefill and decode graphs
    ms: dict[str, list[float]] = {"plan": [], "graph": [], "llama": []}
    res: dict = {}
    for _ in range(repeats):
        for name, m in models.items():
            ms[name].append(hf_static_ms(m, ids))
        if llama_run is not None:
            try:
                ms["llama"].append(llama_run()[0][0])
            except RuntimeError as e:  # reported; the backend's rows still stand
                res["llama_error"], llama_run = f"in the backend rounds: {e}", None
    plans = [r.decode_plan for r in REPORTS if r.decode_plan]
    res.update(backend_plan_ms=summarize(ms["plan"]), backend_graph_ms=summarize(ms["graph"]),
               backend_decode_plan=plans[0] if plans else {})  # fmt: skip
    if llama_run is not None and ms["llama"]:
        res["backend_llama"] = summarize(ms["llama"])
        res["backend_over_llama_by_round"] = by_round(ms["plan"], ms["llama"])
    return res


def step_batch(runner, batch: int, seed: int):
    """A decode batch of ``batch`` sequences at context DECODE_CONTEXT (prefilled on the
    graph into blocks of their own)."""
    rng = random.Random(seed)
    bs, nxt, items = runner.block_size, 0, []
    for _ in range(batch):
        toks = [rng.randrange(10, 40000) for _ in range(DECODE_CONTEXT + 1)]
        k = -(-len(toks) // bs)
        items.append((toks, 0, DECODE_CONTEXT, list(range(nxt, nxt + k))))
        nxt += k
    runner.execute_graph(runner.pack(items, [True] * batch))
    return runner.pack([(t, DECODE_CONTEXT, 1, b) for t, _, _, b in items], [True] * batch)


def graph_ops(runner, b, steps: int = 10) -> list[dict]:
    """Per-op time of the compiled graph's step (torch.profiler, self CPU time)."""
    from torch.profiler import ProfilerActivity, profile

    runner.execute_graph(b)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            runner.execute_graph(b)
    rows = []
    for e in prof.key_averages():
        if e.key.startswith(("topg::", "aten::")) or "Torch-Compiled" in e.key:
            rows.append({"op": e.key, "ms": e.self_cpu_time_total / 1e3 / steps,
                         "calls": e.count / steps})  # fmt: skip
    rows.sort(key=lambda r: -r["ms"])
    return rows[:12]


def run_dtype(dtype: str, a, llama: dict | str) -> dict:
    from torch_topg.compile.decode_plan import profile

    res: dict = {"dtype": dtype}
    llama_run = None  # one llama-bench round, or None (the reason is in res["llama_error"])
    batched_run = None  # one llama-batched-bench round (batch 1 and 8), or None
    if isinstance(llama, str):
        res["llama_error"] = llama
    else:
        from engine_llama import gguf_for, llama_batched_step_ms, llama_decode_samples

        try:
            gguf = gguf_for(dtype, llama["llama-quantize"])
            llama_run = lambda: llama_decode_samples(llama["llama-bench"], gguf)  # noqa: E731
            batched_run = lambda: llama_batched_step_ms(llama["llama-batched-bench"], gguf)  # noqa: E731
        except Exception as e:  # reported; the rest still stands
            res["llama_error"] = str(e)
    plan_eng, graph_eng = _engine(dtype, True), _engine(dtype, False)
    try:
        res["plan_reason"] = plan_eng.stats()["decode_plan"]["reason"]
        rng = random.Random(1)
        for eng in (plan_eng, graph_eng):
            engine_decode_ms(eng, rng)  # warm-up
        plan_ms, graph_ms, llama_ms = [], [], []
        llama_step: dict[int, list[float]] = {}  # sequences -> ms per step, by round
        for _ in range(a.repeats):
            plan_ms.append(engine_decode_ms(plan_eng, rng))
            graph_ms.append(engine_decode_ms(graph_eng, rng))
            if llama_run is not None:
                try:
                    samples, res["llama_cmd"] = llama_run()
                    llama_ms.append(samples[0])
                except Exception as e:  # reported; the rest still stands
                    res["llama_error"], llama_run = str(e), None
            if batched_run is not None:
                try:
                    steps, res["llama_batched_cmd"] = batched_run()
                    for n, ms in steps.items():
                        llama_step.setdefault(n, []).append(ms)
                except Exception as e:  # reported; the rest still stands
                    res["llama_batched_error"], batched_run = str(e), None
        res["engine_plan_ms"] = summarize(plan_ms)
        res["engine_graph_ms"] = summarize(graph_ms)
        if llama_run is not None and llama_ms:
            res["llama"] = summarize(llama_ms)
            res["llama_ms"] = res["llama"].median
            res["plan_over_llama_by_round"] = by_round(plan_ms, llama_ms)
        if batched_run is not None and llama_step:
            res["llama step b1"] = summarize(llama_step[1])
            res["llama step b8"] = summarize(llama_step[8])
            res["llama_b8_over_b1"] = by_round(llama_step[8], llama_step[1])
        res["plan_steps"] = plan_eng.stats()["decode_plan"]["steps"]
        r = plan_eng.runner
        b1, b8 = step_batch(r, 1, 2), step_batch(r, 8, 3)

        def plan(b):
            return lambda: r.plan.run(b.input_ids, b.positions, b.slot_mapping, b.block_tables,
                                      b.seq_lens, b.cu_seqlens_q, b.logits_indices)  # fmt: skip

        cmp = compare({"plan b1": plan(b1), "graph b1": lambda: r.execute_graph(b1),
                       "plan b8": plan(b8), "graph b8": lambda: r.execute_graph(b8)},
                      Budget(warmup=3, min_rounds=10, max_rounds=15, budget_s=6.0))  # fmt: skip
        for name in cmp.names:
            res["step " + name] = cmp.ms(name)
        res["b8_over_b1"] = cmp.ratio("plan b8", "plan b1")
        res["graph_b8_over_b1"] = cmp.ratio("graph b8", "graph b1")
        r.plan.reset_profile()
        for _ in range(30):
            plan(b1)()
        res["plan_phases"] = profile(r.plan)
        res["graph_ops"] = graph_ops(r, b1)
        res["bytes"] = read_bytes_per_step(plan_eng.model, DECODE_CONTEXT)
    finally:
        plan_eng.shutdown()
        graph_eng.shutdown()
    res.update(backend_static(dtype, a.repeats, llama_run))
    return res


def _llama(a) -> dict | str:
    if a.no_llama:
        return "skipped (--no-llama)"
    from llama_cpp_build import LlamaCppUnavailable, ensure_llama_cpp

    try:
        return ensure_llama_cpp()
    except LlamaCppUnavailable as e:
        return f"llama.cpp unavailable: {e}"


def report(results: list[dict], bw: list[Stats], notes: list[str]) -> str:
    lines = ["# Decode step: one native call per step", "", *notes, ""]
    for res in results:
        d = res["dtype"]
        bwm = sum(s.median for s in bw) / len(bw)
        limit = res["bytes"] / bwm * 1e3
        lines += [f"## {d}", ""]
        lines += ["| measure | topg plan | compiled graph (before) | llama.cpp | limit | plan / llama.cpp | plan of limit |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        lm = res.get("llama_ms")
        pm, gm = res["engine_plan_ms"], res["engine_graph_ms"]
        lines.append(
            f"| engine decode ms/token, batch 1, context {DECODE_CONTEXT} | {pm.fmt()} | {gm.fmt()} | "
            f"{res['llama'].fmt() if lm else res.get('llama_error', '-')} | {limit:.2f} | "
            f"{f'{pm.median / lm:.2f}x' if lm else '-'} | {limit / pm.median:.0%} |"
        )
        bp, bg = res["backend_plan_ms"], res["backend_graph_ms"]
        bl = res.get("backend_llama")  # llama.cpp in the backend's own rounds
        lines.append(
            f'| `backend="topg"` + `generate(cache_implementation="static")` ms/token | '
            f"{bp.fmt()} | {bg.fmt()} | {bl.fmt() if bl else '-'} | {limit:.2f} | "
            f"{f'{bp.median / bl.median:.2f}x' if bl else '-'} | {limit / bp.median:.0%} |"
        )
        s1, s8 = res["step plan b1"], res["step plan b8"]
        l1, l8 = res.get("llama step b1"), res.get("llama step b8")
        lines.append(f"| step alone, batch 1 (ms) | {s1.fmt()} | {res['step graph b1'].fmt()} | "
                     f"{l1.fmt() if l1 else '-'} | {limit:.2f} | "
                     f"{f'{s1.median / l1.median:.2f}x' if l1 else ''} | {limit / s1.median:.0%} |")  # fmt: skip
        lines.append(f"| step alone, batch 8 (ms) | {s8.fmt()} | {res['step graph b8'].fmt()} | "
                     f"{l8.fmt() if l8 else '-'} | | {f'{s8.median / l8.median:.2f}x' if l8 else ''} | |")  # fmt: skip
        lb = res.get("llama_b8_over_b1")
        peer = (f", llama.cpp {lb.fmt()}x (its own step of 1 and of 8 sequences, per round; "
                f"`{res['llama_batched_cmd']}`; timed in the engine rounds, step 1, minutes "
                "before the plan's step times)" if lb else
                f", llama.cpp: {res.get('llama_batched_error', res.get('llama_error', '-'))}")  # fmt: skip
        lines += ["", f"Batch 8 step over batch 1 step (target <= {TARGET_B8_OVER_B1}x): plan "
                  f"{res['b8_over_b1'].fmt()}x, graph {res['graph_b8_over_b1'].fmt()}x{peer}. "
                  "Bytes per "
                  f"batch-1 step {res['bytes'] / 1e6:.1f} MB; plan decode steps in the engine rounds: "
                  f"{res['plan_steps']}.", ""]  # fmt: skip
        if lm:
            t = TARGET_VS_LLAMA[d]
            lines.append(f"- engine decode {pm.median:.2f} ms vs llama.cpp {lm:.2f} ms = "
                         f"{pm.median / lm:.2f}x (target <= {t}x: {'met' if pm.median / lm <= t else 'missed'}); "
                         f"per round (engine and llama.cpp in turn): {res['plan_over_llama_by_round'].fmt()}x")  # fmt: skip
        if bl:
            t = TARGET_BACKEND_VS_LLAMA
            r = bp.median / bl.median
            lines.append(f"- `backend=\"topg\"` static-cache generate {bp.median:.2f} ms vs llama.cpp "
                         f"{bl.median:.2f} ms in the same rounds = {r:.2f}x (target <= {t}x: "
                         f"{'met' if r <= t else 'missed'}); per round: "
                         f"{res['backend_over_llama_by_round'].fmt()}x; its decode graph on the "
                         f"plan: {res['backend_decode_plan']}")  # fmt: skip
        if lm:
            lines.append(f"- llama.cpp at {limit / lm:.0%} of the limit; `{res['llama_cmd']}`")
        if d == "fp32":
            ok = limit / pm.median >= TARGET_OF_LIMIT_FP32
            lines.append(
                f"- plan at {limit / pm.median:.0%} of the limit (target >= 80%: {'met' if ok else 'missed'})"
            )
        ph = res["plan_phases"]
        lines += ["", f"Plan phases per step (batch 1, {ph['steps']} steps, member 0's clock, "
                  "waits at the barrier included):", "", "| phase | ms |", "|---|---|"]  # fmt: skip
        for k, v in ph["seconds"].items():
            lines.append(f"| {k} | {v / max(ph['steps'], 1) * 1e3:.3f} |")
        lines += ["", "Compiled graph per op (batch 1, torch.profiler self CPU time per step):", "",
                  "| op | ms | calls |", "|---|---|---|"]  # fmt: skip
        for o in res["graph_ops"]:
            lines.append(f"| {o['op']} | {o['ms']:.3f} | {o['calls']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="fp32,bf16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_results")
    p.add_argument("--md", default=None)
    p.add_argument("--no-llama", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(THREADS)
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    llama = _llama(a)
    bw = [read_bandwidth_stats()]
    results = []
    for d in a.dtype.split(","):
        results.append(run_dtype(d, a, llama))
        print(f"{d}: engine plan {results[-1]['engine_plan_ms'].fmt()} ms, graph "
              f"{results[-1]['engine_graph_ms'].fmt()} ms, backend static "
              f"{results[-1]['backend_plan_ms'].fmt()} ms, llama.cpp {results[-1].get('llama_ms')} ms", flush=True)  # fmt: skip
    remeasure()
    bw.append(read_bandwidth_stats())
    notes = [f"- command: `python python/benchmarks/decode_step.py {' '.join(argv or sys.argv[1:])}`",
             f"- date {date}; {THREADS} threads; SmolLM2-135M-Instruct; read bandwidth before / after: "
             + " / ".join(f"{s.median / 1e9:.1f} GB/s" for s in bw)]  # fmt: skip
    rows = []
    for res in results:
        figs = {k: v.to_dict() for k, v in res.items() if isinstance(v, Stats)}
        rows.append({"key": {"dtype": res["dtype"]}, "figures": figs,
                     "extra": {k: v for k, v in res.items() if not isinstance(v, Stats)}})  # fmt: skip
    machine = machine_info(measure=False)
    rec = new_record("decode_step", rows, machine, notes=notes, date=date)
    path = write_record(validate(rec), a.out)
    text = report(results, bw, notes)
    print("\n" + text + f"\nrecord: {path}")
    if a.md:
        Path(a.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
