"""torch_topg.enable() on unchanged Hugging Face eager code: SmolLM2-135M-Instruct.

One run, ratios measured side by side: a decode step (batch 1, context 256, transformers'
DynamicCache) and a 256-token prefill, in fp32 and bf16, with and without
``torch_topg.enable()``; plus the per-call cost of an intercepted aten op against the
plain aten call at a tiny size (``F.rms_norm`` on one 64-wide row and
``F.scaled_dot_product_attention`` on one 8-key head): the adapter is C++ behind the
dispatcher, so the difference is the kernels', with no Python on the path.

    python python/benchmarks/eager_enable.py [--quick]

Runs with and without ``enable()`` alternate round by round (``torch_topg.bench.compare``);
every figure is a median with its spread; the record goes to ``bench_results/``.

Targets (set when enable() was built): decode >= 1.3x, prefill >= 1.1x faster with enable().
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_topg
from torch_topg.bench import Budget, describe, machine_info, new_record, write_record
from torch_topg.bench.rows import Row, measure

CONTEXT = 256


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
    # Decode must read every weight once (tied embedding / lm_head counted once).
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for what, fn, target, rounds in (
        ("decode", decode, 1.3, runs * 3),
        ("prefill256", prefill, 1.1, runs),
    ):
        budget = Budget(warmup=2, min_rounds=rounds, max_rounds=rounds, min_sample_s=0.0)
        with torch.inference_mode():
            rows.append(measure(
                "eager_enable", "smollm2",
                f"{what} (ctx {CONTEXT})" if what == "decode" else what, name,
                {"topg": fn, "hf_eager": fn}, quick=quick, budget=budget,
                contexts={"topg": torch_topg.enabled}, target=("hf_eager", target),
                dram_bytes=nbytes if what == "decode" else None,
            ))  # fmt: skip
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
            rows.append(measure(
                "eager_enable", "per-call", case, "fp32", {"topg": fn, "aten": fn},
                quick=False, contexts={"topg": torch_topg.enabled},
            ))  # fmt: skip
    return rows


def run(quick: bool) -> list[Row]:
    rows = _overhead()
    for dtype in (torch.float32, torch.bfloat16):
        rows += _decode_and_prefill(dtype, quick)
    return rows


def table(rows: list[Row]) -> str:
    """Markdown: per row, stock and enable() ms, the speed-up per round, the fraction of
    the decode step's DRAM limit, the target's verdict."""
    lines = [
        "| what | dtype | stock ms | enable() ms | speed-up | of limit | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        base = r.baselines[0]
        ratio = r.ratios[base]
        limit = "-"
        if "limit" in r.ratios:
            lim = r.ratios["limit"]
            limit = f"{lim.median:.0%} [{lim.lo:.0%}-{lim.hi:.0%}]"
        target = f">= {r.target[1]}x, {r.verdict}" if r.target else "-"
        lines.append(
            f"| {r.op} {r.case} | {r.dtype} | {r.figures[base].fmt('.3f')} | "
            f"{r.topg.fmt('.3f')} | {ratio.median:.2f}x [{ratio.lo:.2f}-{ratio.hi:.2f}] | "
            f"{limit} | {target} |"
        )
    return "\n".join(lines)


def render_record(rec: dict) -> str:
    """The docs block (docs/integrations.md) of an ``eager_enable`` record."""
    rows = [Row.from_dict(d) for d in rec["rows"]]
    head = f"Run {rec['date']} at commit {rec['commit']}: {describe(rec['machine'])}"
    return f"{head}\n\n{table(rows)}\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (default: torch's own choice)"
    )
    p.add_argument("--out", default="bench_results", help="folder for the JSON record")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = machine_info()
    print(describe(machine))
    rows = run(args.quick)
    print(table(rows))
    rec = new_record("eager_enable", [r.to_dict() for r in rows], machine, quick=args.quick)
    print(f"wrote {write_record(rec, args.out)}")


if __name__ == "__main__":
    main()
