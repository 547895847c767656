"""Engine benchmark: torch_topg.Engine beside transformers and llama.cpp, one run.

Same weights everywhere (SmolLM2-135M-Instruct: the engine's default model, its
de-quantised safetensors for transformers, the same GGUF converted to F32 / BF16 for
llama.cpp), same prompts, same token ids, 2 threads:

(a) throughput: 16 chat requests (rendered with the tokenizer's chat template, 35-60
    tokens) submitted at once, 128 new tokens each (EOS ignored, greedy): output
    tokens/s of the engine, of transformers 5 continuous batching
    (``model.generate_batch``), of transformers ``generate`` on the padded batch and of
    ``llama-server --parallel 16`` (16 concurrent HTTP requests to /completion), with the
    FLOP rate each reaches and the measured fp32 GEMM peak; the engine's mean batch size
    and TTFT percentiles;
(b) batch 1: decode ms/token at context 256 and TTFT of a 512-token prompt, engine vs
    ``llama-bench`` (``-n 64 -d 256`` and ``-p 512``);
(c) memory: peak RSS (VmHWM) of each system's process, measured alone, and the
    engine's RSS after each round of requests.

Each Python system runs in a fresh subprocess; llama.cpp runs as its own processes
(built once by ``llama_cpp_build.py``; if that fails the llama.cpp column says why).

    python python/benchmarks/engine.py [--dtype fp32,bf16] [--md bench_results/engine.md]
        [--systems engine,hf-cb,hf-generate,llama] [--rounds 5] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_common import (
    CONCURRENCY,
    DECODE_CONTEXT,
    DECODE_TOKENS,
    DTYPES,
    HF_NUM_BLOCKS,
    HF_PAGE_SIZE,
    MAX_MODEL_LEN,
    NEW_TOKENS,
    THREADS,
    TTFT_PROMPT,
    _setup_torch,
    _torch_dtype,
    chats,
    med,
    model_shape,
    prompt_ids,
)
from engine_llama import gguf_for, run_llama_bench, run_llama_server
from engine_report import render, to_record

from torch_topg.bench import Stopwatch, timed
from torch_topg.bench.memory import peak_rss_mb, resident_mb, rss_mb


# --- workers (each in its own process) ------------------------------------------------
def _settled_stats(eng) -> dict:
    """``eng.stats()`` once the loop is idle: a request's result is released before the
    loop adds that step to its counters, so wait until two reads agree."""
    prev = eng.stats()
    for _ in range(200):
        time.sleep(0.02)
        cur = eng.stats()
        if cur["steps"] == prev["steps"] and cur["tokens"] == prev["tokens"]:
            return cur
        prev = cur
    return prev


def w_engine(dtype: str, rounds: int, new_tokens: int) -> dict:
    """Throughput + RSS per round: 1 warm-up round (chat messages: the engine renders
    them itself; checked against our ids), then ``rounds`` rounds submitting the ids."""
    _setup_torch()
    from torch_topg.engine import Engine

    eng, load_s = timed(
        Engine.from_pretrained,
        None,
        dtype=dtype,
        max_batch_size=CONCURRENCY,
        max_model_len=MAX_MODEL_LEN,
    )
    eng.wait_warm()  # the warm-up's background compile (engine.md)
    rss_load = rss_mb()
    ids = prompt_ids(eng.tokenizer)
    kw = dict(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    rounds_out, rss_after, kv_resident, problems = [], [], [], []
    kv_tensors = getattr(getattr(eng, "runner", None), "kv_caches", None) or []
    first_tokens = None
    for r in range(rounds + 1):
        st0 = _settled_stats(eng)
        inputs = chats() if r == 0 else ids
        sw = Stopwatch()
        with sw.lap():
            handles = [eng.submit(x, **kw) for x in inputs]
            outs = [h.result(timeout=1800) for h in handles]
        wall = sw.last
        st1 = _settled_stats(eng)
        rss_after.append(rss_mb())
        kv_resident.append(resident_mb(kv_tensors))
        for j, (o, want) in enumerate(zip(outs, ids, strict=True)):
            if o.prompt_token_ids != want:
                problems.append(f"round {r} request {j}: prompt ids differ from ours")
            if len(o.token_ids) != new_tokens or o.finish_reason != "length":
                problems.append(
                    f"round {r} request {j}: {len(o.token_ids)} tokens, {o.finish_reason}"
                )
        if r == 0:
            continue
        if first_tokens is None:
            first_tokens = [o.token_ids for o in outs]
        elif [o.token_ids for o in outs] != first_tokens:
            problems.append(f"round {r}: greedy tokens differ from round 1")
        b0, b1 = st0["steps"]["batch_sizes"], st1["steps"]["batch_sizes"]
        steps = {k: b1.get(k, 0) - b0.get(k, 0) for k in b1}
        nsteps = sum(steps.values())
        computed = st1["tokens"]["computed"] - st0["tokens"]["computed"]
        rounds_out.append(
            {
                "wall_s": wall,
                "tokens": sum(len(o.token_ids) for o in outs),
                "ttft_s": [o.ttft for o in outs],
                "steps": nsteps,
                "mean_batch": sum(k * v for k, v in steps.items()) / max(nsteps, 1),
                "computed": computed,
                "cached_prompt_tokens": sum(o.cached_prompt_tokens for o in outs),
            }
        )
    st = eng.stats()
    eng.shutdown()
    return {
        "system": "engine",
        "load_s": load_s,
        "rss_load_mb": rss_load,
        "rss_after_rounds_mb": rss_after,  # [warm-up, round 1, ...]
        "kv_resident_mb": kv_resident,  # of the KV pool, after each round
        "peak_rss_mb": peak_rss_mb(),
        "kv_bytes": st["kv"]["bytes"],
        "kv_blocks": st["kv"]["blocks_total"],
        "compile": st["compile"],
        "warmup_s": st["time"].get("warmup_s"),
        "rounds": rounds_out,
        "prompt_lens": [len(x) for x in ids],
        "tokens": first_tokens,
        "problems": problems,
    }


def _rand_ids(gen, n: int) -> list[int]:
    import torch

    return torch.randint(10, 40000, (n,), generator=gen).tolist()


def w_engine_batch1(dtype: str, repeats: int) -> dict:
    """Batch 1: decode ms/token after a 256-token prompt (64 new tokens, the time per
    output token after the first) and TTFT of a 512-token prompt; a new random prompt
    each time."""
    torch = _setup_torch()
    from torch_topg.engine import Engine

    eng = Engine.from_pretrained(
        None, dtype=dtype, max_batch_size=CONCURRENCY, max_model_len=MAX_MODEL_LEN
    )
    g = torch.Generator().manual_seed(0)
    kw = dict(temperature=0, ignore_eos=True)
    eng.wait_warm()  # the warm-up's background compile (engine.md)
    eng.generate(_rand_ids(g, DECODE_CONTEXT), max_new_tokens=8, **kw)  # warm-up
    for _ in range(2):
        eng.generate(_rand_ids(g, TTFT_PROMPT), max_new_tokens=1, **kw)
    decode, ttft = [], []
    for _ in range(repeats):
        o = eng.generate(_rand_ids(g, DECODE_CONTEXT), max_new_tokens=DECODE_TOKENS, **kw)[0]
        tt = o.outputs[0].token_times
        decode.append((tt[-1] - tt[0]) / (len(tt) - 1) * 1e3)
    for _ in range(repeats):
        o = eng.generate(_rand_ids(g, TTFT_PROMPT), max_new_tokens=1, **kw)[0]
        ttft.append(o.ttft * 1e3)
    eng.shutdown()
    return {"system": "engine-batch1", "decode_ms": med(decode), "ttft_ms": med(ttft)}


def _hf_model(dtype: str):
    torch = _setup_torch()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from torch_topg.models.hf import smollm2_folder

    d = smollm2_folder()
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=_torch_dtype(dtype)).eval()
    return torch, model, tok


def w_hf_cb(dtype: str, repeats: int, new_tokens: int) -> dict:
    """transformers 5 continuous batching: ``generate_batch`` on the same ids (greedy,
    EOS disabled with eos_token_id=-1), a KV cache of the engine's token capacity."""
    (torch, model, tok), load_s = timed(_hf_model, dtype)
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    rss_load = rss_mb()
    ids = prompt_ids(tok)

    def run(n: int):
        gc = GenerationConfig(
            do_sample=False, eos_token_id=-1, max_new_tokens=n, pad_token_id=tok.pad_token_id
        )
        cb = ContinuousBatchingConfig(
            page_size=HF_PAGE_SIZE, num_blocks=HF_NUM_BLOCKS, max_batch_tokens=512
        )
        with torch.inference_mode():
            out, s = timed(
                model.generate_batch,
                ids,
                generation_config=gc,
                continuous_batching_config=cb,
                max_new_tokens=n,
            )
            return s, list(out.values())

    run(8)  # warm-up
    walls, tokens, problems = [], None, []
    for _ in range(repeats):
        wall, outs = run(new_tokens)
        walls.append(wall)
        toks = [list(o.generated_tokens) for o in outs]
        errs = [o.error for o in outs if o.error]
        if errs or len(outs) != len(ids) or any(len(t) != new_tokens for t in toks):
            problems.append(
                f"{len(outs)} outputs, lengths {sorted({len(t) for t in toks})}, errors {errs[:2]}"
            )
        tokens = tokens or toks
    return {
        "system": "hf-cb",
        "load_s": load_s,
        "rss_load_mb": rss_load,
        "attn": model.config._attn_implementation,
        "walls_s": walls,
        "tokens_per_round": CONCURRENCY * new_tokens,
        "tokens": tokens,
        "peak_rss_mb": peak_rss_mb(),
        "rss_after_mb": rss_mb(),
        "problems": problems,
    }


def w_hf_generate(dtype: str, repeats: int, new_tokens: int) -> dict:
    """transformers ``generate`` (eager: not compiled, its default SDPA attention) on the
    16 prompts left-padded into one batch, greedy, exactly ``new_tokens`` each
    (min_new_tokens). Also the memory baseline of plain transformers."""
    (torch, model, tok), load_s = timed(_hf_model, dtype)
    rss_load = rss_mb()
    ids = prompt_ids(tok)
    width = max(len(x) for x in ids)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])

    def run(n: int):
        with torch.inference_mode():
            out, s = timed(
                model.generate,
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
            return s, out[:, width:].tolist()

    run(4)  # warm-up
    walls, tokens = [], None
    for _ in range(repeats):
        wall, toks = run(new_tokens)
        walls.append(wall)
        tokens = tokens or toks
    return {
        "system": "hf-generate",
        "load_s": load_s,
        "rss_load_mb": rss_load,
        "walls_s": walls,
        "tokens_per_round": CONCURRENCY * new_tokens,
        "tokens": tokens,
        "peak_rss_mb": peak_rss_mb(),
        "rss_after_mb": rss_mb(),
        "problems": [],
    }


WORKERS = {
    "engine": lambda a: w_engine(a.dtype, a.rounds, a.new_tokens),
    "engine-batch1": lambda a: w_engine_batch1(a.dtype, a.repeats_b1),
    "hf-cb": lambda a: w_hf_cb(a.dtype, a.repeats, a.new_tokens),
    "hf-generate": lambda a: w_hf_generate(a.dtype, a.repeats, a.new_tokens),
}


def spawn(name: str, dtype: str, a: argparse.Namespace, timeout: float = 3600) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--dtype",
        dtype,
        "--rounds",
        str(a.rounds),
        "--repeats",
        str(a.repeats),
        "--repeats-b1",
        str(a.repeats_b1),
        "--new-tokens",
        str(a.new_tokens),
    ]
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "cmd": shlex.join(cmd)}
    for line in reversed(p.stdout.splitlines()):
        if line.startswith("{"):
            res = json.loads(line)
            res["wall_process_s"] = time.perf_counter() - t0
            return res
    tail = (p.stderr or p.stdout).strip().splitlines()[-25:]
    return {"error": f"exit {p.returncode}:\n" + "\n".join(tail), "cmd": shlex.join(cmd)}


# --- llama.cpp --------------------------------------------------------------------------
def machine_check() -> dict:
    """torch's fp32 GEMM rate now (a fresh measurement) and the 1-minute load average:
    the machine is shared, and a drop says another process had the cores."""
    from torch_topg.bench import gemm_rate, remeasure

    remeasure()
    try:
        load1 = os.getloadavg()[0]
    except OSError:
        load1 = float("nan")
    return {"gemm": gemm_rate(), "load1": load1}


def run_dtype(dtype: str, a: argparse.Namespace, llama: dict | str, shape: dict) -> dict:
    from transformers import AutoTokenizer, GenerationConfig

    from torch_topg.models.hf import smollm2_folder

    tok = AutoTokenizer.from_pretrained(smollm2_folder())
    ids = prompt_ids(tok)
    eos = {tok.eos_token_id}
    gen_eos = GenerationConfig.from_pretrained(smollm2_folder()).eos_token_id
    eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    res: dict = {
        "dtype": dtype,
        "prompt_lens": [len(x) for x in ids],
        "eos_ids": sorted(e for e in eos if e is not None),
    }
    systems = a.systems.split(",")

    res["checks"] = {}

    def check(name):
        res["checks"][name] = c = machine_check()
        print(f"[{dtype}] {name}: GEMM {c['gemm'] / 1e9:.0f} GFLOP/s, load {c['load1']:.2f}")

    def log(name, r):
        if "error" in r:
            print(f"[{dtype}] {name}: ERROR {r['error']}", flush=True)
        else:
            print(f"[{dtype}] {name}: done ({r.get('wall_process_s', 0):.0f} s)", flush=True)

    for name in ("engine", "engine-batch1", "hf-cb", "hf-generate"):
        if name.split("-batch1")[0] in systems or name in systems:
            check(name)
            res[name] = spawn(name, dtype, a)
            log(name, res[name])
    if "llama" in systems:
        if isinstance(llama, str):
            res["llama-server"] = {"error": llama}
            res["llama-bench"] = {"error": llama}
        else:
            out = Path(a.md).parent
            try:
                gguf = gguf_for(dtype, llama["llama-quantize"])
                res["gguf"] = str(gguf)
            except Exception as e:
                res["llama-server"] = res["llama-bench"] = {"error": str(e)}
            else:
                for key, fn in (
                    (
                        "llama-server",
                        lambda: run_llama_server(
                            llama["llama-server"], gguf, ids, a.rounds, a.new_tokens,
                            out / f"llama-server-{dtype}.log",
                        ),
                    ),
                    ("llama-bench", lambda: run_llama_bench(llama["llama-bench"], gguf, a.repeats_b1)),
                ):  # fmt: skip
                    check(key)
                    t0 = time.perf_counter()
                    try:
                        res[key] = fn()
                    except Exception as e:
                        res[key] = {"error": f"{type(e).__name__}: {e}"}
                    res[key]["wall_process_s"] = time.perf_counter() - t0
                    log(key, res[key])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp32,bf16")
    ap.add_argument("--md", default="bench_results/engine.md")
    ap.add_argument("--systems", default="engine,hf-cb,hf-generate,llama")
    ap.add_argument(
        "--rounds", type=int, default=5, help="throughput rounds of the engine and llama-server"
    )
    ap.add_argument(
        "--repeats", type=int, default=3, help="throughput rounds of transformers generate_batch"
    )
    ap.add_argument("--repeats-b1", type=int, default=7, help="batch-1 repetitions")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    ap.add_argument("--quick", action="store_true", help="16 new tokens, 1-2 repetitions")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(WORKERS[a.worker](a)))
        return
    if a.quick:
        a.new_tokens, a.rounds, a.repeats, a.repeats_b1 = 16, 2, 1, 2
    dtypes = [d.strip() for d in a.dtype.split(",")]
    for d in dtypes:
        if d not in DTYPES:
            ap.error(f"--dtype: expected fp32 and/or bf16, got {d!r}")
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    torch = _setup_torch()
    import transformers

    md = Path(a.md)
    md.parent.mkdir(parents=True, exist_ok=True)
    gemm = machine_check()["gemm"]
    print(f"fp32 GEMM {gemm / 1e9:.1f} GFLOP/s; torch {torch.__version__}, {THREADS} threads")
    llama: dict | str = "not requested"
    notes: dict[str, str] = {}
    if "llama" in a.systems.split(","):
        from llama_cpp_build import VERSION, LlamaCppUnavailable, cache_dir, ensure_llama_cpp

        t0 = time.perf_counter()
        try:
            llama = ensure_llama_cpp()
        except LlamaCppUnavailable as e:
            llama = f"llama.cpp build failed: {e}"
            print(llama, flush=True)
        bs = cache_dir() / "build_seconds.txt"
        builds = bs.read_text().strip().replace("\n", "; ") if bs.exists() else "?"
        notes["llama.cpp build"] = (
            f"vendored in llama-cpp-python {VERSION}; builds: {builds} (cached in "
            f"{cache_dir()}; this run waited {time.perf_counter() - t0:.0f} s for it)"
        )
    shape = model_shape()
    meta = {
        "command": command,
        "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": THREADS,
        "cpu": _cpu_name(),
        "commit": _git_commit(),
        "gemm_flops": gemm,
        "new_tokens": a.new_tokens,
        "llama": "llama-cpp-python 0.3.36's vendored llama.cpp (llama-server, llama-bench)"
        if isinstance(llama, dict)
        else llama,
        "notes": notes,
    }
    results = []
    for d in dtypes:
        results.append(run_dtype(d, a, llama, shape))
        rates = [gemm] + [c["gemm"] for r in results for c in r["checks"].values()]
        meta["gemm_flops"], meta["gemm_min"] = max(rates), min(rates)
        table, summary = render(results, meta, shape)
        md.write_text(table + "\n")
        md.with_suffix(".json").write_text(
            json.dumps({"meta": meta, "shape": shape, "results": results}, indent=1, default=str)
        )
    print()
    print(table)
    print(summary)
    from torch_topg.bench import write_record

    rec = to_record(results, meta, a.quick)
    print(f"\nwrote {md}, {md.with_suffix('.json')} and {write_record(rec, md.parent)}")


def _git_commit() -> str:
    """HEAD of the checkout the engine is imported from, and whether torch_topg/ differs."""
    import torch_topg

    root = Path(torch_topg.__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--", "torch_topg", "csrc"],
            capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        return head + (" (with uncommitted changes in torch_topg/ or csrc/)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _cpu_name() -> str:
    """Model name, family/model and the vector extensions that decide GEMM speed."""
    try:
        info: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            info.setdefault(k.strip(), v.strip())
        flags = set(info.get("flags", "").split())
        ext = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
        return (
            f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}, {' '.join(ext)}; {os.cpu_count()} CPUs)"
        )
    except OSError:
        return platform.processor() or platform.machine()


if __name__ == "__main__":
    main()
