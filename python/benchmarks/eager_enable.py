"""torch_topg.enable() on unchanged Hugging Face eager code: SmolLM2-135M-Instruct.

One run, ratios measured side by side: a decode step (batch 1, context 256, transformers'
DynamicCache) and a 256-token prefill, in fp32 and bf16, with and without
``torch_topg.enable()``; plus the per-call cost of an intercepted aten op against the
plain aten call at a tiny size (``F.rms_norm`` on one 64-wide row and
``F.scaled_dot_product_attention`` on one 8-key head): the adapter is C++ behind the
dispatcher, so the difference is the kernels', with no Python on the path.

    python python/benchmarks/eager_enable.py [--quick]

Targets (issue 4): decode >= 1.3x, prefill >= 1.1x faster with enable().
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Row, bw_limit_ms

import torch_topg
from torch_topg.utils.benchmark import bench

CONTEXT = 256


def _interleaved(fn, rounds: int) -> tuple[float, float]:
    """Median ms of ``fn`` without and with enable(), alternating run by run so that the
    load of a shared machine drifting during the benchmark hits both sides alike."""
    base: list[float] = []
    topg: list[float] = []
    with torch.inference_mode():
        for warm in (fn, fn):
            warm()
        for _ in range(rounds):
            base.append(bench(fn, warmup=0, min_runs=1, max_runs=1, min_time_s=0).median_ms)
            with torch_topg.enabled():
                if not topg:
                    fn()  # warm-up of the topg path
                topg.append(bench(fn, warmup=0, min_runs=1, max_runs=1, min_time_s=0).median_ms)
    return statistics.median(base), statistics.median(topg)


def _decode_and_prefill(dtype: torch.dtype, quick: bool) -> list[Row]:
    from transformers import DynamicCache

    from torch_topg.models import load_smollm2

    model, _ = load_smollm2(dtype)
    ids = torch.randint(
        0, model.config.vocab_size, (1, CONTEXT), generator=torch.Generator().manual_seed(0)
    )
    nxt = torch.tensor([[42]])
    runs = 3 if quick else 8

    def prefill() -> None:
        model(ids, cache=DynamicCache(config=model.config), use_cache=True)

    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)

    def decode() -> None:
        model(nxt, cache=cache, use_cache=True)
        cache.crop(-1)  # back to CONTEXT tokens: every step sees the same context

    rows = []
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    for what, fn, target, rounds in (
        ("decode", decode, 1.3, runs * 3),
        ("prefill256", prefill, 1.1, runs),
    ):
        base, topg = _interleaved(fn, rounds)
        # Decode must read every weight once (tied embedding / lm_head counted once).
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        rows.append(
            Row(
                family="eager_enable",
                op="smollm2",
                case=f"{what} (ctx {CONTEXT})" if what == "decode" else what,
                dtype=name,
                topg_ms=topg,
                baselines={"hf_eager": base},
                limit_ms=bw_limit_ms(nbytes) if what == "decode" else None,
                limit_kind="read bw" if what == "decode" else "",
                target=("hf_eager", target),
            )
        )
    return rows


def _overhead() -> list[Row]:
    x, w = torch.randn(1, 64), torch.randn(64)
    q, k = torch.randn(1, 1, 1, 64), torch.randn(1, 1, 8, 64)
    rows = []
    for case, fn in (
        ("F.rms_norm [1, 64]", lambda: F.rms_norm(x, (64,), w, 1e-6)),
        ("F.sdpa 1 head, 8 keys", lambda: F.scaled_dot_product_attention(q, k, k)),
    ):
        with torch.inference_mode():
            base = bench(fn, min_time_s=0.3).median_ms
            with torch_topg.enabled():
                topg = bench(fn, min_time_s=0.3).median_ms
        rows.append(
            Row(
                family="eager_enable",
                op="per-call",
                case=case,
                dtype="fp32",
                topg_ms=topg,
                baselines={"aten": base},
            )
        )
    return rows


def run(quick: bool) -> list[Row]:
    rows = _overhead()
    for dtype in (torch.float32, torch.bfloat16):
        rows += _decode_and_prefill(dtype, quick)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's own choice)"
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch threads: {torch.get_num_threads()}")
    print("| what | dtype | stock ms | enable() ms | speed-up | limit ms | target |")
    print("|---|---|---|---|---|---|---|")
    for r in run(args.quick):
        ((name, base),) = r.baselines.items()
        limit = f"{r.limit_ms:.2f}" if r.limit_ms else "-"
        target = f">= {r.target[1]}x {'ok' if r.ok else 'MISSED'}" if r.target else "-"
        print(
            f"| {r.op} {r.case} | {r.dtype} | {base:.3f} | {r.topg_ms:.3f} | "
            f"{r.ratio(name):.2f}x | {limit} | {target} |"
        )
