"""Benchmark every topg CPU kernel against its reference, the best stock PyTorch way and
the physical limit, in one run; print a table and write the record (JSON) and a plot.

    python python/benchmarks/bench_ops.py            # full sizes
    python python/benchmarks/bench_ops.py --quick    # fewer sizes and rounds (the demo)
    python python/benchmarks/bench_ops.py --only attention,linear
    python python/benchmarks/bench_ops.py --runs 3   # three runs in a row, one record each

Every variant of a row is timed in interleaved rounds by ``torch_topg.bench.compare``;
each figure and each ratio is the median with its spread (p10-p90 over 10 or more
rounds, else min-max). A target is met when the ratio's median meets it; a row whose
spread holds the target is "within noise". Limits are measured in this run: the read
bandwidth (a buffer of 8x the LLC, all threads) for rows whose bytes come from DRAM,
"in cache" for those that do not; for compute-bound rows the best rate any variant
reached on that shape and the theoretical fp32 peak. The record goes to
``bench_results/ops[-quick]-<date>-<commit>.json``; ``render_readme.py`` builds the
the targets table of docs/ops.md from it, ``python -m torch_topg bench compare A.json B.json`` compares two.
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import sys
import time
import traceback

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import torch_topg  # noqa: E402
from torch_topg.bench import (  # noqa: E402
    Stats,
    describe,
    load_average,
    machine_info,
    new_record,
    remeasure,
    theoretical_peak,
    write_record,
)
from torch_topg.bench.rows import Row  # noqa: E402

FAMILIES = ["norm", "rotary", "activation", "routing", "attention", "linear", "moe"]


def fmt_ms(v: Stats) -> str:
    m = v.median
    spec = ".4f" if m < 0.1 else ".3f" if m < 10 else ".1f"
    return v.fmt(spec)


def fmt_ratio(v: Stats) -> str:
    if v.n <= 1:
        return f"{v.median:.2f}x (n=1)"
    return f"{v.median:.2f}x [{v.lo:.2f}-{v.hi:.2f}]"


def fmt_pct(v: Stats) -> str:
    if v.n <= 1:
        return f"{v.median:.0%}"
    return f"{v.median * 100:.0f}% [{v.lo * 100:.0f}-{v.hi * 100:.0f}]"


def limit_cell(r: Row) -> str:
    if "limit" in r.ratios:
        bw = f"{r.read_bw.median / 1e9:.1f} GB/s; " if r.read_bw else ""
        others = "".join(
            f"<br>{fmt_pct(v)} {k[len('limit ') :]}"
            for k, v in r.ratios.items()
            if k.startswith("limit ")
        )
        return f"{fmt_pct(r.ratios['limit'])} of read bw ({bw}{r.regime}){others}"
    if "of best" in r.ratios:
        best = r.note.split("best: ")[-1] if "best: " in r.note else "?"
        rate = f", {r.flops / r.topg.median / 1e6:.0f} GFLOP/s" if r.flops else ""
        cell = f"{fmt_pct(r.ratios['of best'])} of best ({best}){rate}"
        if "of peak" in r.ratios:
            cell += f"<br>{fmt_pct(r.ratios['of peak'])} of fp32 peak"
        return cell
    return r.regime or "-"


def target_cells(r: Row) -> tuple[str, str]:
    if not r.target:
        return "", ""
    name, minimum = r.target
    is_limit = name == "limit" or name.startswith("limit ")
    target = f">= {minimum}x {name}"
    if is_limit:
        target = f">= {minimum:.0%} of limit" + (
            f" ({name[len('limit ') :]})" if name != "limit" else ""
        )
    v = r.verdict or ""
    if v == "not measured":
        return target, "not measured (in cache)"
    shown = fmt_pct(r.ratios[name]) if is_limit else fmt_ratio(r.ratios[name])
    met = "yes" if v.startswith("met") else f"**no** ({shown})"
    if "within noise" in v:
        met += ", within noise"
    return target, met


def table(rows: list[Row]) -> str:
    head = "| op | case | dtype | topg ms | vs stock | vs reference | of limit | target | met |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        stock = [n for n in r.baselines if n != "reference"]
        vs_stock = "<br>".join(f"{fmt_ratio(r.ratios[n])} {n}" for n in stock) or "-"
        vs_ref = fmt_ratio(r.ratios["reference"]) if "reference" in r.ratios else "-"
        target, met = target_cells(r)
        lines.append(
            f"| {r.op} | {r.case} | {r.dtype} | {fmt_ms(r.topg)} | {vs_stock} | {vs_ref} "
            f"| {limit_cell(r)} | {target} | {met} |"
        )
    return "\n".join(lines)


def summary(rows: list[Row]) -> str:
    """Targets met, rows within noise and in cache, the largest fraction of a limit."""
    targeted = [r for r in rows if r.target]
    met = [r for r in targeted if r.ok]
    noise = [r for r in targeted if r.verdict and "within noise" in r.verdict]
    in_cache = [r for r in rows if r.regime.startswith("in cache")]
    text = (
        f"targets met: {len(met)} of {len(targeted)} (median meets the target); "
        f"{len(noise)} within noise (spread holds the target: "
        f"{', '.join(f'{r.op} {r.case} {r.dtype}' for r in noise) or 'none'}); "
        f"{len(in_cache)} rows in cache (not compared with the DRAM limit)"
    )
    for name, label in (
        ("limit", "read bw"),
        ("of best", "the fastest variant (GEMM)"),
        ("of peak", "fp32 peak"),
    ):
        have = [r for r in rows if name in r.ratios]
        if have:
            top = max(have, key=lambda r: r.ratios[name].median)
            text += (
                f"; largest % of {label}: {fmt_pct(top.ratios[name])} "
                f"({top.op} {top.case} {top.dtype})"
            )
    # Over 100% of the DRAM limit in every round: the byte count or the probe is wrong.
    over = [r for r in rows if "limit" in r.ratios and r.ratios["limit"].lo > 1.0]
    if over:
        text += "; ABOVE the read-bandwidth limit in every round: " + ", ".join(
            f"{r.op} {r.case} {r.dtype} ({fmt_pct(r.ratios['limit'])})" for r in over
        )
    return text + "."


def render(rec: dict, targets_only: bool = False) -> str:
    """The Markdown of a record: machine, table, summary."""
    rows = [Row.from_dict(d) for d in rec["rows"]]
    shown = [r for r in rows if r.target] if targets_only else rows
    head = (
        f"Run {rec['date']} at commit {rec['commit']}{' (dirty)' if rec.get('dirty') else ''}"
        f"{', --quick' if rec.get('quick') else ''}: {describe(rec['machine'])}"
    )
    notes = "".join(f"- {n}\n" for n in rec.get("notes", []) if "failed" in n or "skipped" in n)
    return f"{head}\n\n{table(shown)}\n\n{summary(rows)}\n" + (f"\n{notes}" if notes else "")


def plot(rows: list[Row], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, speedups, errs, fractions = [], [], [[], []], []
    for r in rows:
        stock = [n for n in r.baselines if n != "reference"]
        labels.append(f"{r.op} {r.case} {r.dtype}")
        s = r.ratios[stock[0]] if stock else Stats(0, 0, 0, 1, "n=1")
        speedups.append(s.median)
        errs[0].append(s.median - s.lo)
        errs[1].append(s.hi - s.median)
        frac = r.ratios.get("limit") or r.ratios.get("of best")
        fractions.append(frac.median if frac else 0.0)
    fig, axes = plt.subplots(1, 2, figsize=(16, max(4, 0.28 * len(rows))), sharey=True)
    y = range(len(rows))
    axes[0].barh(y, speedups, xerr=errs, color="tab:blue")
    axes[0].axvline(1.0, color="k", lw=0.8)
    axes[0].set_xscale("log")
    axes[0].set_xlabel("speed-up over the best stock PyTorch way (log; bars: spread)")
    axes[1].barh(y, fractions, color="tab:green")
    axes[1].axvline(1.0, color="k", lw=0.8)
    axes[1].set_xlabel("fraction of the DRAM limit, or of the best GEMM rate (0: in cache)")
    axes[0].set_yticks(list(y), labels, fontsize=7)
    axes[0].invert_yaxis()
    fig.suptitle("torch_topg CPU kernels (one run; ratios measured side by side)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def settle_peak(rows: list[Row], machine: dict) -> None:
    """A peak that a measurement exceeds is no limit. Without cpufreq (a VM) the clock is
    cpuinfo's nominal one, and the cores boost above it: the peak is then taken at the
    clock the fastest fp32 arithmetic of the whole run implies (median rate of any
    variant of an fp32 compute row, or of topg on any row: topg computes in fp32; torch's
    bf16 GEMMs use bf16 dot-product instructions, another peak), and every row's "of
    peak" is rescaled to it."""
    rates = [
        r.flops / (ms.median / 1e3)
        for r in rows
        if r.flops
        for name, ms in r.figures.items()
        if ms.median > 0 and (r.dtype == "fp32" or name == "topg")
    ]
    old = machine["peak"]["fp32_flops"]
    if not rates or old <= 0:
        return
    measured = max([*rates, machine["peak"].get("measured_flops", 0.0)])
    peak = theoretical_peak(measured_flops=measured)
    if peak["fp32_flops"] <= old:
        return
    machine["peak"] = {**peak, "measured_flops": measured}
    for r in rows:
        if "of peak" in r.ratios:
            r.ratios["of peak"] = r.ratios["of peak"].scaled(old / peak["fp32_flops"])


def run_once(args: argparse.Namespace, families: list[str]) -> pathlib.Path:
    t_start = time.perf_counter()
    remeasure()  # each run measures its own limits
    machine = machine_info()
    print(describe(machine), flush=True)
    rows: list[Row] = []
    notes: list[str] = []
    for fam in families:
        try:
            module = importlib.import_module(f"families.{fam}")
        except ModuleNotFoundError as exc:
            notes.append(f"[{fam}] skipped: {exc}")
            print(notes[-1])
            continue
        t0 = time.perf_counter()
        try:
            fam_rows = module.run(args.quick)
        except Exception as exc:  # one family's failure must not lose the others' rows
            traceback.print_exc()
            notes.append(f"[{fam}] failed: {type(exc).__name__}: {exc}")
            continue
        rows += fam_rows
        print(f"[{fam}] {len(fam_rows)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    settle_peak(rows, machine)
    notes.append(f"wall time of the run: {time.perf_counter() - t_start:.0f} s")
    notes.append(f"1-min load average at the end: {load_average()}")
    rec = new_record("ops", [r.to_dict() for r in rows], machine, quick=args.quick, notes=notes)
    path = write_record(rec, args.out)
    md = render(rec)
    print("\n" + md)
    out = pathlib.Path(args.out)
    (out / "table.md").write_text(md)
    (out / "targets.md").write_text(render(rec, targets_only=True))
    if not args.no_plot:
        try:
            plot(rows, out / "plot.png")
        except Exception as exc:  # matplotlib missing or headless trouble: the record stands
            print(f"plot skipped: {exc}")
    print(f"wrote {path}, {out}/table.md, targets.md, plot.png")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and rounds (the demo)")
    ap.add_argument("--only", default="", help="comma-separated families: " + ",".join(FAMILIES))
    ap.add_argument("--out", default="bench_results", help="folder for the record and tables")
    ap.add_argument("--runs", type=int, default=1, help="run this many times, one record each")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not torch_topg.native_available():
        print("warning: native kernels not loaded; topg rows time the reference fallback")
    print(f"torch threads: {torch.get_num_threads()}")
    families = [f for f in FAMILIES if not args.only or f in args.only.split(",")]
    paths = [run_once(args, families) for _ in range(args.runs)]
    if len(paths) > 1:
        print("records:", " ".join(str(p) for p in paths))


if __name__ == "__main__":
    main()
