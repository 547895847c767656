"""Tensor parallel on CPU: tp=2 (2 processes x 1 thread, gloo) vs tp=1 (1 process x 2
threads), decode and prefill, eager and ``backend="topg"``; and the fused all-reduce +
residual add + RMSNorm against the unfused sequences.

    python python/benchmarks/tp.py --quick     # llama-150m only, fewer steps (~2 min)
    python python/benchmarks/tp.py             # + mixtral-360m and SmolLM2

Self-contained: spawns its own workers (FileStore rendezvous, each bounded by a
timeout) and prints a markdown table. On a 2-core machine tp=2 and tp=1 use the same
two cores, so the ratio measures what sharding costs or saves in communication and
per-thread efficiency, not what a second device would add (see docs/parallel.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _model(name: str) -> torch.nn.Module:
    from torch_topg.models import build_model, load_smollm2

    return load_smollm2()[0] if name == "smollm2" else build_model(name)


def _step_fns(model: torch.nn.Module, prompt: int, compile_: bool):
    """(prefill(), decode_step()) closures on a fixed prompt; decode continues one cache
    (as python/benchmarks/bench_models.py does: the model makes its own DynamicCache)."""
    fn = torch.compile(model, backend="topg") if compile_ else model
    ids = torch.arange(prompt).unsqueeze(0) % 1000 + 5
    state: dict = {}

    def prefill() -> None:
        fn(input_ids=ids, use_cache=True)

    def decode() -> None:
        if "cache" not in state or state["n"] >= 64:  # bounded context: steady cost
            out = fn(input_ids=ids[:, :16], use_cache=True)
            state["cache"], state["n"] = out.past_key_values, 0
            state["tok"] = out.logits[:, -1:].argmax(-1)
        out = fn(input_ids=state["tok"], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["tok"] = out.past_key_values, out.logits[:, -1:].argmax(-1)
        state["n"] += 1

    return prefill, decode


def _time(fn, runs: int) -> dict:
    """ms per call: a ``Stats`` dict. A fixed number of runs, one call each: every rank
    must make the same collective calls."""
    from torch_topg.bench import bench

    t = bench(fn, warmup=3, min_runs=runs, max_runs=runs, min_time_s=0.0)
    return t.stats.scaled(1e3).to_dict()


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    world = args.world
    if world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{args.store}",
            rank=args.rank,
            world_size=world,
            timeout=timedelta(seconds=300),
        )
    import torch_topg
    from torch_topg.parallel import tensor_parallel

    res: dict = {}
    steps = 6 if args.quick else 24
    with torch.inference_mode():
        for name in args.models:
            model = _model(name)  # one build per model: eager first, then compiled
            if world > 1:
                tensor_parallel(model)
            for mode in ("eager", "topg"):
                torch._dynamo.reset()
                prefill, decode = _step_fns(model, args.prompt, mode == "topg")
                res[f"{name}|{mode}|decode"] = _time(decode, steps)
                res[f"{name}|{mode}|prefill {args.prompt}"] = _time(prefill, max(3, steps // 4))
            del model
        if world > 1:
            res.update(_fusion(50 if args.quick else 400))
    if args.rank == 0:
        Path(args.out).write_text(json.dumps(res))
    if world > 1:
        dist.destroy_process_group()
    del torch_topg


def _fusion(runs: int) -> dict[str, dict]:
    """all_reduce + add + RMSNorm at decode / prefill sizes: fused op vs two sequences,
    interleaved round by round (one call per sample, a fixed number of rounds: every
    rank makes the same calls); ms ``Stats`` dicts, and the per-round ratio."""
    from torch_topg import ops
    from torch_topg.bench import Budget, compare

    res = {}
    for tokens, hidden in ((1, 768), (1, 512), (128, 768)):
        x, r, w = torch.randn(tokens, hidden), torch.randn(tokens, hidden), torch.rand(hidden)

        def fused() -> None:
            ops.fused_all_reduce_add_rms_norm(x, r, w, 1e-5)

        def half() -> None:  # all_reduce, then the fused add + norm
            s = ops.all_reduce(x)
            ops.fused_add_rms_norm(s, r, w, 1e-5)

        def unfused() -> None:  # what eager transformers does after a row-parallel layer
            h = r + ops.all_reduce(x)
            ops.rms_norm(h, w, 1e-5)

        case = f"allreduce_norm|T={tokens} H={hidden}"
        variants = {
            "fused": fused,
            "all_reduce + fused_add_rms_norm": half,
            "all_reduce + add + rms_norm": unfused,
        }
        cmp = compare(variants, Budget(warmup=3, min_sample_s=0.0), rounds=runs)
        for name in variants:
            res[f"{case}|{name}"] = cmp.ms(name).to_dict()
        res[f"{case}|ratio"] = cmp.ratio("all_reduce + add + rms_norm", "fused").to_dict()
    return res


def _launch(world: int, threads: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"tp{world}.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, __file__, "--worker", "--world", str(world), "--threads", str(threads)]
    cmd += ["--store", str(tmp / f"store{world}"), "--out", str(out), "--prompt", str(args.prompt)]
    cmd += ["--models", *args.models] + (["--quick"] if args.quick else [])
    procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(world)]
    try:
        for p in procs:
            if p.wait(timeout=args.timeout) != 0:
                raise RuntimeError(f"tp={world} worker failed (exit {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return json.loads(out.read_text())


def _ms(d: dict) -> str:
    from torch_topg.bench import Stats

    return Stats.from_dict(d).fmt(".2f")


def table(tp1: dict, tp2: dict) -> str:
    """tp=1 and tp=2 run in separate processes one after the other: their ratio is of
    the medians (no per-round ratio); the fused all-reduce rows are interleaved."""
    from torch_topg.bench import Stats

    lines = [
        "| model | mode | decode tp=1 / tp=2 ms | tp=2 speed-up | prefill tp=1 / tp=2 ms "
        "| tp=2 speed-up |",
        "|---|---|---|---|---|---|",
    ]
    cells: dict[tuple[str, str], list[str]] = {}
    for key, t1 in tp1.items():  # "model|mode|decode" then "model|mode|prefill N"
        name, mode, _phase = key.split("|")
        t2 = tp2[key]
        ratio = t1["median"] / t2["median"]
        cells.setdefault((name, mode), []).extend([f"{_ms(t1)} / {_ms(t2)}", f"{ratio:.2f}x"])
    for (name, mode), c in cells.items():
        lines.append(f"| {name} | {mode} | {' | '.join(c)} |")
    lines += [
        "",
        "| all-reduce + add + RMSNorm (tp=2) | fused us | all_reduce + fused_add_rms_norm us "
        "| all_reduce + add + rms_norm us | fused vs unfused (per round) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    cases = sorted({k.split("|")[1] for k in tp2 if k.startswith("allreduce_norm")})
    for c in cases:
        f, h, u = (
            Stats.from_dict(tp2[f"allreduce_norm|{c}|{n}"]).scaled(1e3).fmt(".1f")
            for n in ("fused", "all_reduce + fused_add_rms_norm", "all_reduce + add + rms_norm")
        )
        ratio = Stats.from_dict(tp2[f"allreduce_norm|{c}|ratio"]).fmt(".2f")
        lines.append(f"| {c} | {f} | {h} | {u} | {ratio}x |")
    return "\n".join(lines)


def render_record(rec: dict) -> str:
    """The docs block (docs/parallel.md) of a ``tp`` record (its rows back into ``table``'s dicts)."""
    from torch_topg.bench import describe

    tp1, tp2 = {}, {}
    for row in rec["rows"]:
        parts = row["key"].split(" | ")
        if parts[0] == "allreduce_norm":
            for n, f in row["figures"].items():
                tp2[f"allreduce_norm|{parts[1]}|{n}"] = f
            tp2[f"allreduce_norm|{parts[1]}|ratio"] = row["ratios"]["unfused / fused"]
        else:
            tp1["|".join(parts)] = row["figures"]["tp=1"]
            tp2["|".join(parts)] = row["figures"]["tp=2"]
    head = f"Run {rec['date']} at commit {rec['commit']}: {describe(rec['machine'])}"
    return f"{head}\n\n{table(tp1, tp2)}\n"


def record_rows(tp1: dict, tp2: dict) -> list[dict]:
    rows = [
        {"key": key.replace("|", " | "), "unit": "ms", "figures": {"tp=1": t1, "tp=2": tp2[key]}}
        for key, t1 in tp1.items()
    ]
    cases = sorted({k.split("|")[1] for k in tp2 if k.startswith("allreduce_norm")})
    for c in cases:
        names = ("fused", "all_reduce + fused_add_rms_norm", "all_reduce + add + rms_norm")
        rows.append({
            "key": f"allreduce_norm | {c} | tp=2", "unit": "ms",
            "figures": {n: tp2[f"allreduce_norm|{c}|{n}"] for n in names},
            "ratios": {"unfused / fused": tp2[f"allreduce_norm|{c}|ratio"]},
        })  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--models", nargs="*")
    ap.add_argument("--prompt", type=int, default=128, help="prefill tokens")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--results", default="bench_results", help="folder for the JSON record")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for a in ("--rank", "--world", "--threads"):
        ap.add_argument(a, type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if not args.models:
        from torch_topg.models import smollm2_available

        args.models = ["llama-150m"] if args.quick else ["llama-150m", "mixtral-360m"]
        if not args.quick and smollm2_available() is None:
            args.models.append("smollm2")
    if args.quick:
        args.prompt = min(args.prompt, 64)
    with tempfile.TemporaryDirectory() as d:
        tp1 = _launch(1, 2, args, Path(d))
        tp2 = _launch(2, 1, args, Path(d))
    print(f"\ncores: {os.cpu_count()}; tp=2 runs 2 processes on the same cores as tp=1\n")
    print(table(tp1, tp2))
    from torch_topg.bench import machine_info, new_record, write_record

    machine = machine_info()
    rec = new_record("tp", record_rows(tp1, tp2), machine, quick=args.quick)
    print(f"wrote {write_record(rec, args.results)}")


if __name__ == "__main__":
    main()
