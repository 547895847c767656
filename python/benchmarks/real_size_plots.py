"""The real-size pictures from the records of real_size.py, real_size_context.py and
real_size_serve.py (bench_results/), torch_topg beside llama.cpp:

* docs/real_size_decode.png: batch-1 decode time against the bytes a step reads (every
  shape and format measured; the line is the read limit, the bytes over the read
  bandwidth measured in the run), and each side's share of that limit;
* docs/real_size_context.png: decode time per token and time to first token against the
  context length;
* docs/real_size_serve.png: output tokens/s against concurrency through ``serve`` and
  ``llama-server``.

    python python/benchmarks/real_size_plots.py [--results bench_results] [--docs docs]

Per (shape, format[, context / concurrency]) the newest row measured on this machine
type is drawn; the commits the rows come from are named in the titles. The weights are
random: speed does not depend on their values.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torch_topg.bench.machine import machine_info
from torch_topg.bench.record import load_record

TOPG, LLAMA = "#1f6fb4", "#d9822b"


def newest_rows(results: Path, benchmark: str) -> tuple[dict, list[str]]:
    """``{row key: (row, record)}``, the newest per key among this machine type's records
    of ``benchmark`` (any machine's when none is of this type), and their commits."""
    recs = []
    for p in sorted(results.glob(f"{benchmark}-2*.json")):
        try:
            recs.append(load_record(p))
        except ValueError:
            continue
    model = machine_info(measure=False).get("cpu_model", "")
    recs = [r for r in recs if r["machine"].get("cpu_model", "") == model] or recs
    rows: dict = {}
    for r in sorted(recs, key=lambda r: r["date"]):
        for row in r["rows"]:
            rows[row["key"]] = (row, r)
    commits = sorted({r["commit"] for _, r in rows.values()})
    return rows, commits


def _series(rows: dict, by: str) -> list[tuple[tuple[str, str], list[dict]]]:
    """The rows per (shape, format), sorted, each series ordered by its ``by`` field."""
    series: dict = {}
    for row, _ in rows.values():
        series.setdefault((row["shape"], row["format"]), []).append(row)
    return [(k, sorted(v, key=lambda r: r[by])) for k, v in sorted(series.items())]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _topg_name(fig: dict) -> str:
    return min((k for k in fig if not k.startswith("llama")), key=lambda k: fig[k]["median"])


def decode_plot(results: Path, out: Path, plt) -> Path | None:
    rows, commits = newest_rows(results, "real_size")
    if not rows:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    pts = []
    for row, rec in rows.values():
        f = row["figures"]
        name = _topg_name(f)
        limit = row["read_limit_ms"]
        bw = rec["machine"].get("read_bw") or {}
        nbytes = row.get("read_bytes") or limit * 1e-3 * float(bw.get("median", 0))
        gb = nbytes / 1e9
        pts.append((row["shape"], row["format"], gb, limit, f[name], f["llama.cpp"]))
    pts.sort(key=lambda p: p[2])
    for _, _, gb, _, t, lc in pts:
        a.errorbar(gb, t["median"], yerr=[[t["median"] - t["lo"]], [t["hi"] - t["median"]]],
                   fmt="o", color=TOPG, capsize=3)  # fmt: skip
        a.errorbar(gb, lc["median"], yerr=[[lc["median"] - lc["lo"]], [lc["hi"] - lc["median"]]],
                   fmt="s", color=LLAMA, capsize=3)  # fmt: skip
    xs = [p[2] for p in pts]
    ms_per_gb = [p[3] / p[2] for p in pts if p[2] > 0]
    if ms_per_gb:
        k = sum(ms_per_gb) / len(ms_per_gb)
        lo, hi = min(xs) * 0.9, max(xs) * 1.1
        a.plot([lo, hi], [lo * k, hi * k], "k--", lw=1, label="read limit")
    a.plot([], [], "o", color=TOPG, label="torch_topg")
    a.plot([], [], "s", color=LLAMA, label="llama.cpp")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("GB read per decode step (weights + KV; each format and size)")
    a.set_ylabel("ms / token (batch 1, 2 threads)")
    a.set_title("batch-1 decode against bytes read")
    a.legend(fontsize=8)
    labels = [f"{p[0].split('-')[-1]}\n{p[1]}" for p in pts]
    x = range(len(pts))
    a_share = [p[3] / p[4]["median"] for p in pts]
    l_share = [p[3] / p[5]["median"] for p in pts]
    b.bar([i - 0.2 for i in x], a_share, 0.4, color=TOPG, label="torch_topg")
    b.bar([i + 0.2 for i in x], l_share, 0.4, color=LLAMA, label="llama.cpp")
    b.axhline(0.92, color="k", ls=":", lw=1, label="92% (BF16 / Q8_0 target)")
    b.set_xticks(list(x), labels, fontsize=7)
    b.set_ylabel("share of the read limit")
    b.set_title("share of the measured read bandwidth")
    b.legend(fontsize=8)
    fig.suptitle(f"Real-size shapes, random weights; commits {', '.join(commits)}", fontsize=9)
    return _save(fig, out / "real_size_decode.png")


def context_plot(results: Path, out: Path, plt) -> Path | None:
    rows, commits = newest_rows(results, "real_size_context")
    if not rows:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.6))
    for (shape, fmt), rs in _series(rows, "context"):
        for ax, key in ((a, "decode"), (b, "prefill")):
            scale = 1.0 if key == "decode" else 1e-3
            for side, color, mark in (("topg", TOPG, "o-"), ("llama.cpp", LLAMA, "s--")):
                name = f"{side} {key}"  # a run may measure one of the two (--measure)
                pts = [(r["context"], r["figures"][name]["median"] * scale)
                       for r in rs if name in r["figures"]]  # fmt: skip
                if pts:
                    ax.plot(*zip(*pts, strict=True), mark, color=color,
                            label=f"{side} {shape.split('-')[-1]} {fmt}")  # fmt: skip
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.legend(fontsize=7)
    a.set_ylabel("ms / token")
    a.set_title("decode time per token at the context")
    b.set_ylabel("s")
    b.set_title("time to first token (prefill of the context)")
    fig.suptitle(f"2 threads each, random weights; commits {', '.join(commits)}", fontsize=9)
    return _save(fig, out / "real_size_context.png")


def serve_plot(results: Path, out: Path, plt) -> Path | None:
    rows, commits = newest_rows(results, "real_size_serve")
    if not rows:
        return None
    fig, a = plt.subplots(figsize=(7, 4.6))
    for i, ((shape, fmt), rs) in enumerate(_series(rows, "concurrency")):
        c = [r["concurrency"] for r in rs]
        dash = ["-", "--", ":", "-."][i % 4]
        for side, color in (("topg", TOPG), ("llama-server", LLAMA)):
            ys = [r["figures"][side]["median"] for r in rs]
            a.plot(c, ys, "o" + dash, color=color, label=f"{side} {shape.split('-')[-1]} {fmt}")
    a.set_xscale("log", base=2)
    a.set_xlabel("concurrent requests")
    a.set_ylabel("output tokens / s")
    a.set_title(f"serve vs llama-server, 2 threads each; commits {', '.join(commits)}", fontsize=9)
    a.legend(fontsize=7)
    return _save(fig, out / "real_size_serve.png")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default="bench_results")
    ap.add_argument("--docs", default="docs")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for draw in (decode_plot, context_plot, serve_plot):
        path = draw(Path(a.results), Path(a.docs), plt)
        print(path or f"{draw.__name__}: no records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
