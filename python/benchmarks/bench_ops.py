"""Benchmark every topg CPU kernel against its reference, the best stock PyTorch way and
the physical limit, in one run; print a table and write it (Markdown, JSON, PNG);
targets.md holds only the rows that carry one of the issue's targets.

    python python/benchmarks/bench_ops.py            # full sizes (a few minutes)
    python python/benchmarks/bench_ops.py --quick    # fewer sizes (the demo)
    python python/benchmarks/bench_ops.py --only attention,linear

Ratios are measured side by side in this run; the physical limits (memory read
bandwidth, fp32 GEMM rate) are measured in this run too. Nothing here is asserted:
rows carry the issue's target and whether this run met it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import platform
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from common import Row, gemm_rate, read_bandwidth  # noqa: E402

import torch_topg  # noqa: E402

FAMILIES = ["norm", "rotary", "activation", "routing", "attention", "linear", "moe"]


def fmt_ms(v: float) -> str:
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def table(rows: list[Row]) -> str:
    head = "| op | case | dtype | topg ms | vs stock | vs reference | of limit | target | met |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        stock = [(k, v) for k, v in r.baselines.items() if k != "reference"]
        vs_stock = "<br>".join(f"{v / r.topg_ms:.2f}x {k}" for k, v in stock) or "-"
        vs_ref = f"{r.ratio('reference'):.2f}x" if "reference" in r.baselines else "-"
        limit = f"{r.ratio('limit'):.0%} {r.limit_kind}" if r.limit_ms else "-"
        if r.target:
            name, minimum = r.target
            target = f">= {minimum:.0%} of limit" if name == "limit" else f">= {minimum}x {name}"
            met = "yes" if r.ok else f"**no** ({r.ratio(name):.2f})"
        else:
            target, met = "", ""
        lines.append(
            f"| {r.op} | {r.case} | {r.dtype} | {fmt_ms(r.topg_ms)} | {vs_stock} | {vs_ref} "
            f"| {limit} | {target} | {met} |"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, speedups, fractions = [], [], []
    for r in rows:
        stock = [v for k, v in r.baselines.items() if k != "reference"]
        labels.append(f"{r.op} {r.case} {r.dtype}")
        speedups.append(stock[0] / r.topg_ms if stock else 0.0)
        fractions.append(r.ratio("limit") if r.limit_ms else 0.0)
    fig, axes = plt.subplots(1, 2, figsize=(16, max(4, 0.28 * len(rows))), sharey=True)
    y = range(len(rows))
    axes[0].barh(y, speedups, color="tab:blue")
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("speed-up over the best stock PyTorch way (log)")
    axes[1].barh(y, fractions, color="tab:green")
    axes[1].axvline(1.0, color="k", lw=0.8)
    axes[1].set_xlabel("fraction of the physical limit (bandwidth or GEMM rate)")
    axes[0].set_yticks(list(y), labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle("torch_topg CPU kernels (one run; ratios measured side by side)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes (the demo)")
    ap.add_argument("--only", default="", help="comma-separated families: " + ",".join(FAMILIES))
    ap.add_argument("--out", default="bench_results", help="folder for table.md/rows.json/plot.png")
    args = ap.parse_args()
    if not torch_topg.native_available():
        print("warning: native kernels not loaded; topg rows time the reference fallback")
    families = [f for f in FAMILIES if not args.only or f in args.only.split(",")]
    bw, gemm = read_bandwidth(), gemm_rate()
    env = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        f"measured read bandwidth {bw / 1e9:.1f} GB/s, fp32 GEMM {gemm / 1e9:.0f} GFLOP/s"
    )
    print(env, flush=True)
    rows: list[Row] = []
    for fam in families:
        try:
            module = importlib.import_module(f"families.{fam}")
        except ModuleNotFoundError as exc:
            print(f"[{fam}] skipped: {exc}")
            continue
        t0 = time.perf_counter()
        fam_rows = module.run(args.quick)
        rows += fam_rows
        print(f"[{fam}] {len(fam_rows)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = f"{env}\n\n{table(rows)}\n"
    print("\n" + md)
    (out / "table.md").write_text(md)
    targeted = [r for r in rows if r.target is not None]
    (out / "targets.md").write_text(f"{env}\n\n{table(targeted)}\n")
    (out / "rows.json").write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    plot(rows, out / "plot.png")
    met = [r.ok for r in rows if r.ok is not None]
    print(
        f"targets met: {sum(met)} of {len(met)}; wrote {out}/table.md, targets.md, rows.json, plot.png"
    )


if __name__ == "__main__":
    main()
