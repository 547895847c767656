"""Pipeline parallel over 2 process-nodes (1 thread each, gloo on loopback) against one
process with 2 threads: 16 streams of greedy decoding, output tokens/s and their ratio,
each stage's idle fraction and communication time per step.

    python python/benchmarks/pipeline_parallel.py            # SmolLM2-135M-shaped, random
    python python/benchmarks/pipeline_parallel.py --layers 8 --new-tokens 32   # shorter
    python python/benchmarks/pipeline_parallel.py --pp-layers 15,15   # split by hand

The model has SmolLM2-135M's shapes (30 layers, hidden 576, 9 / 3 heads, vocab 49152)
with random weights, saved as safetensors. Every system runs in its own process; node 0
and node 1 are two processes joined through ``master_port`` on 127.0.0.1, exactly as two
machines would be (docs/cluster.md). On a 2-core machine both sides use the same two
cores: the ratio says what splitting the layers costs (communication, the stages'
imbalance, the idle time the micro-batches do not fill), not what a second machine adds.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9,
              num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)  # fmt: skip


def _prompts(n: int, length: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 49000, (length,), generator=g).tolist() for _ in range(n)]


def _options(a: argparse.Namespace) -> dict:
    return dict(compile=a.compile, max_batch_size=a.streams, max_model_len=256,
                kv_cache_memory=256 << 20)  # fmt: skip


def _timed(eng, a: argparse.Namespace) -> dict:
    ps = _prompts(a.streams, a.prompt)
    eng.generate(ps[:2], max_new_tokens=4, temperature=0, ignore_eos=True)  # warm
    reset = getattr(eng.runner, "pipeline_stats", None)
    if reset:
        reset(reset=True)
    t0 = time.perf_counter()
    outs = eng.generate(ps, max_new_tokens=a.new_tokens, temperature=0, ignore_eos=True)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    st = eng.stats()
    res = {"tokens_per_s": tokens / wall, "wall_s": wall, "steps": st["steps"]["count"],
           "mean_batch": st["steps"]["mean_batch_size"],
           "decode_plan": st["decode_plan"]["active"],
           "tokens": [o.token_ids for o in outs]}  # fmt: skip
    if reset:
        res["stages"] = eng.runner.pipeline_stats()["stages"]
    return res


def role(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(a.threads)
    from torch_topg.engine import Engine

    opts = _options(a)
    if a.role == "node1":
        Engine.from_pretrained(a.folder, nnodes=2, node_rank=1, master_port=a.port, **opts)
        return
    if a.role == "node0":
        split = [int(x) for x in a.pp_layers.split(",")] if a.pp_layers else None
        eng = Engine.from_pretrained(
            a.folder, nnodes=2, master_port=a.port, pp_layers=split, **opts
        )
    else:
        eng = Engine.from_pretrained(a.folder, decode_plan=a.role == "single", **opts)
    with eng:
        print("RESULT " + json.dumps(_timed(eng, a)), flush=True)


def _run(a: argparse.Namespace, folder: str, name: str, threads: int, port: int = 0):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    argv = [sys.executable, __file__, "--role", name, "--folder", folder, "--threads",
            str(threads), "--port", str(port), "--streams", str(a.streams), "--prompt",
            str(a.prompt), "--new-tokens", str(a.new_tokens), "--layers", str(a.layers)]  # fmt: skip
    if a.compile:
        argv.append("--compile")
    if a.pp_layers:
        argv += ["--pp-layers", a.pp_layers]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)


def _result(p: subprocess.Popen) -> dict:
    out, _ = p.communicate(timeout=1800)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"a benchmark process failed (exit {p.returncode}):\n{out[-3000:]}")
    return json.loads(line.split(" ", 1)[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--folder", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2: 30)")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--compile", action="store_true", help='backend="topg" (slow to start)')
    ap.add_argument("--pp-layers", default=None,
                    help="layers per stage, e.g. 15,15 (default: balanced by bytes)")  # fmt: skip
    a = ap.parse_args()
    if a.role:
        role(a)
        return
    from torch_topg.models import build_model

    with tempfile.TemporaryDirectory() as tmp:
        build_model("llama-tiny", num_hidden_layers=a.layers, **SHAPES).save_pretrained(tmp)
        single = _result(_run(a, tmp, "single", 2))
        eager = _result(_run(a, tmp, "single-graph", 2))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        n1 = _run(a, tmp, "node1", 1, port)
        pp = _result(_run(a, tmp, "node0", 1, port))
        n1.wait(120)
    same = pp.pop("tokens") == single.pop("tokens") == eager.pop("tokens")
    print(f"\nSmolLM2-135M-shaped random Llama, {a.layers} layers, fp32, compile={a.compile}; "
          f"{a.streams} streams x {a.prompt} prompt + {a.new_tokens} new tokens, greedy; "
          f"same tokens everywhere: {same}\n")  # fmt: skip
    print("| system | tokens/s | ratio to 1 x 2 threads | steps | mean batch |")
    print("|---|---|---|---|---|")
    rows = [("1 process x 2 threads (decode plan)", single),
            ("1 process x 2 threads (no decode plan)", eager),
            ("2 process-nodes x 1 thread, pipeline", pp)]  # fmt: skip
    for name, r in rows:
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / single['tokens_per_s']:.2f} "
              f"| {r['steps']} | {r['mean_batch']:.1f} |")  # fmt: skip
    print("\n| stage | layers | compute s | idle s | idle fraction | comm ms / step |")
    print("|---|---|---|---|---|---|")
    for s in pp["stages"]:
        print(f"| {s['stage']} | {s['layers'][0]}..{s['layers'][1] - 1} | {s['compute_s']:.2f} "
              f"| {s['idle_s']:.2f} | {s['idle_fraction']:.2f} | {1e3 * s['comm_s_per_step']:.2f} |")  # fmt: skip
    print(f"\npipeline / (1 x 2 threads, plan): {pp['tokens_per_s'] / single['tokens_per_s']:.2f}; "
          f"pipeline / (1 x 2 threads, no plan): {pp['tokens_per_s'] / eager['tokens_per_s']:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
