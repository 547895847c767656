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
import http.client
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

THREADS = 2
CONCURRENCY = 16
NEW_TOKENS = 128
MAX_MODEL_LEN = 1024  # the engine's context limit: sizes its KV pool (16 slots x 1024 tokens)
DECODE_CONTEXT = 256
DECODE_TOKENS = 64
TTFT_PROMPT = 512
HF_PAGE_SIZE = 256
HF_NUM_BLOCKS = 64  # 64 x 256 tokens: the same token capacity as the engine's pool

# 16 varied user questions; with SmolLM2's chat template (default system prompt) they
# render to 35-60 tokens.
QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about autumn leaves falling on a quiet lake.",
    "How do I reverse a list in Python?",
    "What are the main differences between a virus and a bacterium, and how does each "
    "one make people sick?",
    "Give me three tips for sleeping better.",
    "Why is the sky blue during the day but red at sunset?",
    "Summarize the plot of Romeo and Juliet for a ten-year-old.",
    "What is 17 times 23? Show your steps.",
    "Suggest a name for a small bakery that sells sourdough bread and cinnamon rolls in "
    "a seaside town.",
    "How does a refrigerator keep food cold?",
    "Translate 'good morning, how are you?' into Spanish and German.",
    "What should I pack for a three-day hiking trip in the mountains in early spring, "
    "when nights are still cold?",
    "Explain step by step how a bill becomes a law in the United States, including "
    "what happens after a veto.",
    "Is it better to rent or buy a home? List pros and cons of each.",
    "Write a short, friendly email asking my neighbour to return the ladder I lent him last month.",
]
DTYPES = ("fp32", "bf16")


# --- shared helpers -------------------------------------------------------------------
def chats() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def prompt_ids(tokenizer) -> list[list[int]]:
    """The token ids every system gets: the chat template rendered, then encoded (as the
    engine does for chat messages)."""
    out = []
    for m in chats():
        text = tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return out


def _status_mb(field: str, pid: int | str = "self") -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def rss_mb(pid: int | str = "self") -> float | None:
    return _status_mb("VmRSS", pid)


def peak_rss_mb(pid: int | str = "self") -> float | None:
    return _status_mb("VmHWM", pid)


def resident_mb(tensors) -> float | None:
    """Bytes of ``tensors``' memory that is resident (mincore), in MB: how much of the
    engine's KV pool (torch.empty, committed as blocks are first written) is in RSS."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for t in tensors:
            start = t.data_ptr() // page * page
            end = t.data_ptr() + t.numel() * t.element_size()
            n = -(-(end - start) // page)
            vec = (ctypes.c_ubyte * n)()
            if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(end - start), vec) != 0:
                return None
            total += sum(v & 1 for v in vec) * page
        return total / 2**20
    except (OSError, AttributeError):
        return None


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _setup_torch():
    import torch

    torch.set_num_threads(THREADS)
    return torch


def med(xs: list[float]) -> dict:
    """Repeated measurements summarised by ``torch_topg.bench.summarize`` (median and
    spread: lo-hi), with min, max and the values (the tables print min-max)."""
    from torch_topg.bench import summarize

    return {**summarize(xs).to_dict(), "min": min(xs), "max": max(xs), "values": xs}


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of a distribution (e.g. TTFT p90), not a spread."""
    from torch_topg.bench import quantile

    return quantile(xs, q) if xs else float("nan")


def model_shape() -> dict:
    """Sizes from SmolLM2's config (for the FLOP count)."""
    from transformers import AutoConfig

    from torch_topg.models.hf import smollm2_folder

    c = AutoConfig.from_pretrained(smollm2_folder())
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    h, i, kv, q = c.hidden_size, c.intermediate_size, c.num_key_value_heads, c.num_attention_heads
    per_layer = h * q * hd + 2 * h * kv * hd + q * hd * h + 3 * h * i + 2 * h  # attn, mlp, norms
    non_emb = c.num_hidden_layers * per_layer + h  # + final norm; tied LM head not counted
    return {
        "layers": c.num_hidden_layers,
        "hidden": h,
        "heads": q,
        "kv_heads": kv,
        "head_dim": hd,
        "vocab": c.vocab_size,
        "params_non_embedding": non_emb,
        "params_embedding": c.vocab_size * h,
        "tied": bool(getattr(c, "tie_word_embeddings", False)),
    }


def round_flops(shape: dict, prompt_lens: list[int], new_tokens: int) -> float:
    """FLOPs of one round: per request, every prompt token and every generated token but
    the last passes the model once (T = P + G - 1 positions):
    2 * N_non_emb * T + 4 * L * H_q * d_head * sum_{t=1..T} t (QK^T and PV, causal)."""
    n, attn = (
        shape["params_non_embedding"],
        4 * shape["layers"] * shape["heads"] * shape["head_dim"],
    )
    total = 0.0
    for p in prompt_lens:
        t = p + new_tokens - 1
        total += 2 * n * t + attn * t * (t + 1) / 2
    return total


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

    t0 = time.perf_counter()
    eng = Engine.from_pretrained(
        None, dtype=dtype, max_batch_size=CONCURRENCY, max_model_len=MAX_MODEL_LEN
    )
    load_s = time.perf_counter() - t0
    rss_load = rss_mb()
    ids = prompt_ids(eng.tokenizer)
    kw = dict(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    rounds_out, rss_after, kv_resident, problems = [], [], [], []
    kv_tensors = getattr(getattr(eng, "runner", None), "kv_caches", None) or []
    first_tokens = None
    for r in range(rounds + 1):
        st0 = _settled_stats(eng)
        inputs = chats() if r == 0 else ids
        t0 = time.perf_counter()
        handles = [eng.submit(x, **kw) for x in inputs]
        outs = [h.result(timeout=1800) for h in handles]
        wall = time.perf_counter() - t0
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
    t0 = time.perf_counter()
    torch, model, tok = _hf_model(dtype)
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    load_s = time.perf_counter() - t0
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
            t0 = time.perf_counter()
            out = model.generate_batch(
                ids, generation_config=gc, continuous_batching_config=cb, max_new_tokens=n
            )
            return time.perf_counter() - t0, list(out.values())

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
    t0 = time.perf_counter()
    torch, model, tok = _hf_model(dtype)
    load_s = time.perf_counter() - t0
    rss_load = rss_mb()
    ids = prompt_ids(tok)
    width = max(len(x) for x in ids)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])

    def run(n: int):
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=input_ids,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
            return time.perf_counter() - t0, out[:, width:].tolist()

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
def gguf_for(dtype: str, quantize: Path) -> Path:
    """SmolLM2's shipped GGUF (Q4_1) converted to F32 / BF16 with llama.cpp's quantizer
    (--allow-requantize de-quantises), at the path bench_models.py uses (shared cache)."""
    from torch_topg.models.hf import gguf_path

    cache = Path(os.environ.get("TOPG_CACHE_DIR", Path.home() / ".cache" / "torch_topg"))
    dst = cache / f"smollm2-135m-instruct-{dtype}.gguf"
    if not dst.exists():
        tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
        kind = {"fp32": "F32", "bf16": "BF16"}[dtype]
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
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - t0
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


def run_llama_bench(bench: Path, gguf: Path, repeats: int) -> dict:
    """``llama-bench -p 512 -n 0`` (prefill of 512 tokens = TTFT less sampling) and
    ``-p 0 -n 64 -d 256`` (64 decode steps after a 256-token context)."""
    out = {}
    for key, extra in (
        ("ttft_ms", ["-p", str(TTFT_PROMPT), "-n", "0"]),
        ("decode_ms", ["-p", "0", "-n", str(DECODE_TOKENS), "-d", str(DECODE_CONTEXT)]),
    ):
        cmd = [
            str(bench),
            "-m",
            str(gguf),
            "-t",
            str(THREADS),
            "-r",
            str(repeats),
            "-o",
            "json",
            *extra,
        ]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} exited {p.returncode}: {p.stderr[-400:]}")
        rows = json.loads(p.stdout)
        ns = rows[0]["samples_ns"]
        per = 1 if key == "ttft_ms" else DECODE_TOKENS
        out[key] = med([x / 1e6 / per for x in ns])
        out[key + "_cmd"] = shlex.join(cmd)
        out["flash_attn"] = rows[0].get("flash_attn")
        out["build"] = f"{rows[0].get('build_commit')} ({rows[0].get('build_number')})"
    return out


# --- orchestration ----------------------------------------------------------------------
def agreement(
    ref: list[list[int]] | None, other: list[list[int]] | None, eos: frozenset[int] = frozenset()
) -> str:
    """Identical greedy sequences out of 16 and the mean common prefix length; and how
    many of the first differences are an EOS that ``ref`` emitted and ``other`` did not
    (the engine's and transformers' continuous batching ``ignore_eos`` keep generating
    after an EOS they sample, vLLM's meaning; ``min_new_tokens`` in transformers
    ``generate`` and llama.cpp's ``ignore_eos`` ban EOS, so they take the runner-up)."""
    if not ref or not other or len(ref) != len(other):
        return "-"
    same = sum(a == b for a, b in zip(ref, other, strict=True))
    pref, at_eos = [], 0
    for a, b in zip(ref, other, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        pref.append(k)
        if k < min(len(a), len(b)) and a[k] in eos and b[k] not in eos:
            at_eos += 1
    out = f"{same}/{len(ref)} (prefix {statistics.mean(pref):.0f})"
    if same < len(ref) and eos:
        out += f"; {at_eos} of {len(ref) - same} first differ where the engine emitted EOS"
    return out


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


def throughput_rows(r: dict, shape: dict, gemm: float, new_tokens: int) -> list[dict]:
    flops = round_flops(shape, r["prompt_lens"], new_tokens)
    rows = []
    eng = r.get("engine", {})
    eng_tokens = eng.get("tokens") if "error" not in eng else None
    names = {
        "engine": "torch_topg Engine (16 submitted at once)",
        "hf-cb": "transformers `generate_batch` (continuous batching)",
        "hf-generate": "transformers `generate` (padded batch of 16, eager)",
        "llama-server": "llama.cpp `llama-server --parallel 16`",
    }
    for key, label in names.items():
        x = r.get(key)
        if x is None:
            continue
        if "error" in x:
            rows.append({"label": label, "error": x["error"]})
            continue
        if key == "engine":
            walls = [q["wall_s"] for q in x["rounds"]]
            toks = x["rounds"][0]["tokens"]
        else:
            walls, toks = x["walls_s"], x["tokens_per_round"]
        rate = med([toks / w for w in walls])
        rows.append(
            {
                "label": label,
                "key": key,
                "tok_s": rate,
                "wall_s": statistics.median(walls),
                "gflops": flops / statistics.median(walls) / 1e9,
                "of_peak": flops / statistics.median(walls) / gemm,
                "agree": "reference"
                if key == "engine"
                else agreement(eng_tokens, x.get("tokens"), frozenset(r.get("eos_ids", []))),
                "peak_rss_mb": x.get("peak_rss_mb"),
                "problems": x.get("problems", []),
            }
        )
    return rows


def fmt_m(m: dict, f: str = "{:.1f}") -> str:
    if m["n"] == 1:
        return f.format(m["median"]) + " (n=1)"
    return f"{f.format(m['median'])} [{f.format(m['min'])}-{f.format(m['max'])}] (n={m['n']})"


def render(results: list[dict], meta: dict, shape: dict) -> tuple[str, str]:
    gemm = meta["gemm_flops"]
    nt = meta["new_tokens"]
    L = [
        "# torch_topg Engine benchmark",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; torch {meta['torch']}; transformers {meta['transformers']}; "
        f"{meta['threads']} threads; CPU: {meta['cpu']}",
        f"- torch_topg at {meta.get('commit', '?')}\n"
        f"- model: SmolLM2-135M-Instruct (same weights in every system); llama.cpp: "
        f"{meta['llama']}",
        f"- fp32 GEMM rate of torch (1024^3, `torch_topg.utils.benchmark.gemm_rate`), measured "
        f"before every system in this run: best {gemm / 1e9:.1f} GFLOP/s (the reference for the "
        f"FLOP rates), worst {meta.get('gemm_min', gemm) / 1e9:.1f}; a low one means another "
        "process had the cores (the machine is shared).",
        f"- FLOPs of a round: sum over requests of 2 * N * T + 4 * L * H * d * T(T+1)/2 with "
        f"T = P + {nt} - 1 positions passed through the model (P = prompt tokens), "
        f"N = {shape['params_non_embedding'] / 1e6:.1f}M non-embedding parameters, L = "
        f"{shape['layers']}, H = {shape['heads']} query heads, d = {shape['head_dim']}; the "
        f"tied LM head ({shape['params_embedding'] / 1e6:.1f}M, another "
        f"{shape['params_embedding'] / shape['params_non_embedding']:.0%} of the per-token "
        "matmul work) is not counted.",
        "- `a [b-c] (n=k)`: median, min-max over k repeated measurements.",
        "",
    ]
    summary = []
    for r in results:
        dt = r["dtype"]
        L += [
            f"## {dt}",
            "",
            f"### (a) Throughput: {CONCURRENCY} chat requests (prompts "
            f"{min(r['prompt_lens'])}-{max(r['prompt_lens'])} tokens, "
            f"{sum(r['prompt_lens'])} in all), {nt} new tokens each, greedy, EOS ignored",
            "",
            "| system | output tokens/s | round wall s | GFLOP/s | of measured fp32 GEMM rate | "
            "engine tokens/s over this | greedy tokens identical to engine's | peak RSS MB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows = throughput_rows(r, shape, gemm, nt)
        eng_rate = next((x["tok_s"]["median"] for x in rows if x.get("key") == "engine"), None)
        for x in rows:
            if "error" in x:
                first = x["error"].strip().splitlines()[0] if x["error"].strip() else "error"
                L.append(f"| {x['label']} | not measured: {first[:200]} | | | | | | |")
                continue
            vs = f"{eng_rate / x['tok_s']['median']:.2f}x" if eng_rate else "-"
            L.append(
                f"| {x['label']} | {fmt_m(x['tok_s'])} | {x['wall_s']:.2f} | {x['gflops']:.2f} | "
                f"{x['of_peak']:.1%} | {vs if x['key'] != 'engine' else '1'} | {x['agree']} | "
                f"{x['peak_rss_mb']:.0f} |"
            )
            for p in x["problems"]:
                L.append(f"|  | problem: {p} | | | | | | |")
        if r.get("checks"):
            L += [
                "",
                "Machine check before each system (torch fp32 GEMM GFLOP/s / 1-min load "
                "average): "
                + "; ".join(
                    f"{k} {c['gemm'] / 1e9:.0f} / {c['load1']:.1f}" for k, c in r["checks"].items()
                )
                + ".",
            ]
        e = r.get("engine", {})
        if "rounds" in e:
            ttfts = [t * 1e3 for q in e["rounds"] for t in q["ttft_s"]]
            mb = statistics.mean(q["mean_batch"] for q in e["rounds"])
            comp = [q["computed"] for q in e["rounds"]]
            L += [
                "",
                f"Engine: mean batch size {mb:.2f} (sequences per step, prefill chunks "
                f"included; {statistics.median(q['steps'] for q in e['rounds']):.0f} steps a "
                f"round); TTFT p50 {pct(ttfts, 0.5):.0f} ms, p90 {pct(ttfts, 0.9):.0f} ms "
                f"(n={len(ttfts)}: {len(e['rounds'])} rounds x {CONCURRENCY}); tokens computed "
                f"a round {comp[0]} (= prompts + {CONCURRENCY} x {nt - 1}: "
                f"{sum(r['prompt_lens']) + CONCURRENCY * (nt - 1)}, no prefix reuse); "
                f"compilations while serving: {e['compile'].get('while_serving')}; load + "
                f"compile {e['load_s']:.0f} s.",
            ]
        b = r.get("engine-batch1", {})
        lb = r.get("llama-bench", {})
        L += [
            "",
            "### (b) Batch 1",
            "",
            "| measure | engine ms | llama.cpp ms | engine / llama.cpp (time) |",
            "|---|---|---|---|",
        ]
        for key, label in (
            ("decode_ms", f"decode ms/token at context {DECODE_CONTEXT} ({DECODE_TOKENS} tokens)"),
            ("ttft_ms", f"TTFT, {TTFT_PROMPT}-token prompt"),
        ):
            ev = fmt_m(b[key], "{:.2f}") if key in b else _err(b)
            lv = fmt_m(lb[key], "{:.2f}") if key in lb else _err(lb)
            ratio = (
                f"{b[key]['median'] / lb[key]['median']:.2f}x" if key in b and key in lb else "-"
            )
            L.append(f"| {label} | {ev} | {lv} | {ratio} |")
        if "decode_ms_cmd" in lb:
            L += [
                "",
                f"llama.cpp: `{Path(lb['decode_ms_cmd'].split()[0]).name} "
                f"{' '.join(lb['decode_ms_cmd'].split()[1:])}` (tg{DECODE_TOKENS} at depth "
                f"{DECODE_CONTEXT}, ms per token) and `... {' '.join(lb['ttft_ms_cmd'].split()[-4:])}`"
                f" (pp{TTFT_PROMPT}: prompt processing only, no sampling); flash_attn="
                f"{lb.get('flash_attn')}. Engine: a new random prompt each time; decode = "
                "(last token time - first token time) / 63; TTFT = first token time from "
                "submit (scheduling, prefill, sampling).",
            ]
        L += ["", "### (c) Memory (each system its own process, peak = VmHWM)", ""]
        hg = r.get("hf-generate", {})
        L += [
            "| system | RSS after load MB | peak RSS MB | RSS after each round MB |",
            "|---|---|---|---|",
        ]
        if "rounds" in e:
            L.append(
                f"| engine | {e['rss_load_mb']:.0f} | {e['peak_rss_mb']:.0f} | "
                f"{', '.join(f'{v:.0f}' for v in e['rss_after_rounds_mb'])} (warm-up first) |"
            )
        for key, label in (
            ("hf-generate", "transformers generate (eager)"),
            ("hf-cb", "transformers generate_batch"),
        ):
            x = r.get(key, {})
            if "peak_rss_mb" in x:
                L.append(
                    f"| {label} | {x.get('rss_load_mb', float('nan')):.0f} | {x['peak_rss_mb']:.0f} |"
                    f" {x['rss_after_mb']:.0f} (end) |"
                )
        ls = r.get("llama-server", {})
        if "peak_rss_mb" in ls:
            L.append(
                f"| llama-server | {ls['rss_load_mb']:.0f} | {ls['peak_rss_mb']:.0f} | "
                f"{', '.join(f'{v:.0f}' for v in ls['rss_after_rounds_mb'])} |"
            )
        if "rounds" in e and "peak_rss_mb" in hg:
            bound = hg["peak_rss_mb"] + e["kv_bytes"] / 2**20 + 150
            ok = e["peak_rss_mb"] <= bound
            L += [
                "",
                f"Engine peak {e['peak_rss_mb']:.0f} MB vs transformers eager peak "
                f"{hg['peak_rss_mb']:.0f} MB + configured KV pool {e['kv_bytes'] / 2**20:.0f} MB "
                f"({e['kv_blocks']} blocks, max_model_len {MAX_MODEL_LEN}, 16 slots) + 150 MB = "
                f"{bound:.0f} MB: {'within' if ok else 'OVER'}.",
            ]
        kvr = e.get("kv_resident_mb") or []
        if "rounds" in e and kvr and all(v is not None for v in kvr):
            rss = e["rss_after_rounds_mb"]
            rest = [a - b for a, b in zip(rss, kvr, strict=True)]
            grew = kvr[-1] - kvr[1]
            why = (
                "flat: the rounds reuse the blocks the warm-up round wrote"
                if abs(grew) < 8
                else f"{grew:+.0f} MB: rounds wrote pool blocks never written before (the pool "
                "is torch.empty, its pages commit on first write), bounded by the pool size"
            )
            L += [
                "",
                "Engine RSS after each round (warm-up first), split by mincore into the KV "
                f"pool's resident pages and the rest: KV {', '.join(f'{v:.0f}' for v in kvr)} "
                f"MB; rest {', '.join(f'{v:.0f}' for v in rest)} MB. From round 1 to round "
                f"{len(rest) - 1} the rest changes by {rest[-1] - rest[1]:+.0f} MB and the "
                f"resident KV by {why}.",
            ]
        L.append("")
        # summary
        rows_ok = {x["key"]: x for x in rows if "key" in x}
        s = [f"{dt}:"]
        if "engine" in rows_ok:
            s.append(
                f"  engine {rows_ok['engine']['tok_s']['median']:.1f} tok/s "
                f"({rows_ok['engine']['gflops']:.1f} GFLOP/s, {rows_ok['engine']['of_peak']:.0%} of GEMM peak)"
            )
        for k in ("hf-cb", "hf-generate", "llama-server"):
            if k in rows_ok:
                s.append(
                    f"  {k} {rows_ok[k]['tok_s']['median']:.1f} tok/s (engine "
                    f"{eng_rate / rows_ok[k]['tok_s']['median']:.2f}x)"
                    if eng_rate
                    else f"  {k} {rows_ok[k]['tok_s']['median']:.1f} tok/s"
                )
        for key in ("decode_ms", "ttft_ms"):
            if key in b and key in lb:
                s.append(
                    f"  batch-1 {key}: engine {b[key]['median']:.2f} vs llama.cpp "
                    f"{lb[key]['median']:.2f} ({b[key]['median'] / lb[key]['median']:.2f}x)"
                )
        if "rounds" in e:
            s.append(
                f"  engine peak RSS {e['peak_rss_mb']:.0f} MB; RSS after rounds "
                f"{', '.join(f'{v:.0f}' for v in e['rss_after_rounds_mb'])}"
            )
        summary.append("\n".join(s))
    notes = [f"- {k}: {v}" for k, v in meta.get("notes", {}).items()]
    if notes:
        L += ["## Notes", "", *notes, ""]
    return "\n".join(L), "\n".join(summary)


def _err(x: dict) -> str:
    if "error" in x:
        return "not measured: " + x["error"].strip().splitlines()[0][:160]
    return "-"


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


def to_record(results: list[dict], meta: dict, quick: bool) -> dict:
    """The run as a ``torch_topg.bench`` record: one row per (dtype, system), its
    repeated figures (``med`` dicts) as Stats; tokens/s are higher-is-better."""
    from torch_topg.bench import machine_info, new_record

    rows = []
    for r in results:
        for system, v in r.items():
            if not isinstance(v, dict) or system == "checks":
                continue
            figs = {k: x for k, x in v.items() if isinstance(x, dict) and "spread" in x}
            if figs:
                rows.append({
                    "key": f"{system} | {r['dtype']}", "unit": "as named",
                    "figures": {k: {f: x[f] for f in ("median", "lo", "hi", "n", "spread")}
                                for k, x in figs.items()},
                    "higher_is_better": [k for k in figs if "tok_s" in k or "per_s" in k],
                })  # fmt: skip
    notes = [f"{k}: {v}" for k, v in meta.get("notes", {}).items()]
    return new_record("engine", rows, machine_info(), quick=quick, notes=notes)


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
