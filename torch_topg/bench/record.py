"""The record of a benchmark run: one JSON file per run, and the comparison of two.

Schema (``SCHEMA``)::

    {"schema": "torch_topg.bench/1", "benchmark": "ops", "date": "2026-12-01T09:00:00Z",
     "commit": "73dd340", "dirty": false, "argv": [...], "quick": false,
     "machine": {... torch_topg.bench.machine.machine_info() ...},
     "notes": ["..."],
     "rows": [{"key": "rms_norm | T=1 H=576 | fp32", "unit": "ms",
               "figures": {"topg": Stats, "hf LlamaRMSNorm": Stats, ...},
               "ratios": {"hf LlamaRMSNorm": Stats, "limit": Stats, ...},
               ... anything else the benchmark adds (op, case, dtype, regime, target,
               verdict) ...}]}

``Stats`` is ``{"median", "lo", "hi", "n", "spread"}``. ``compare_records(a, b)`` lists,
per row and figure present in both, what got faster or slower beyond the spread: the
two spreads do not overlap. Lower is better for figures (times) except those a row lists
in ``"higher_is_better"`` (rates, e.g. tokens/s); higher is better for ratios (speed-ups,
fractions of a limit), which are measured side by side and so move less with the load.
"""

from __future__ import annotations

import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path

from torch_topg.bench.timing import Stats

SCHEMA = "torch_topg.bench/1"


def git_commit(cwd: Path | None = None) -> tuple[str, bool]:
    """The short commit of the checkout and whether tracked files differ from it."""
    cwd = cwd or Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return sha or "unknown", bool(dirty)
    except OSError:
        return "unknown", False


def new_record(
    benchmark: str,
    rows: list[dict],
    machine: dict,
    *,
    quick: bool = False,
    notes: list[str] | None = None,
    argv: list[str] | None = None,
    date: str | None = None,
) -> dict:
    commit, dirty = git_commit()
    return {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": date or _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "commit": commit,
        "dirty": dirty,
        "argv": list(sys.argv if argv is None else argv),
        "quick": quick,
        "machine": machine,
        "notes": list(notes or []),
        "rows": rows,
    }


def validate(rec: dict) -> dict:
    """Raise ``ValueError`` unless ``rec`` follows the schema; return it."""
    if rec.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} record (schema {rec.get('schema')!r})")
    for field in ("benchmark", "date", "commit", "machine", "rows"):
        if field not in rec:
            raise ValueError(f"record without {field!r}")
    for row in rec["rows"]:
        if "key" not in row or "figures" not in row:
            raise ValueError(f"row without key/figures: {row!r:.200}")
        for s in [*row["figures"].values(), *row.get("ratios", {}).values()]:
            Stats.from_dict(s)
    return rec


def record_path(rec: dict, out: Path) -> Path:
    stamp = rec["date"].replace("-", "").replace(":", "")
    quick = "-quick" if rec.get("quick") else ""
    return out / f"{rec['benchmark']}{quick}-{stamp}-{rec['commit']}.json"


def write_record(rec: dict, out: Path | str = "bench_results") -> Path:
    """Write ``rec`` under ``out`` as ``<benchmark>[-quick]-<date>-<commit>.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = record_path(validate(rec), out)
    path.write_text(json.dumps(rec, indent=1) + "\n")
    return path


def load_record(path: Path | str) -> dict:
    return validate(json.loads(Path(path).read_text()))


def latest(out: Path | str, benchmark: str, quick: bool = False, n: int = 1) -> list[Path]:
    """The ``n`` newest records of ``benchmark`` under ``out`` (by their date field)."""
    found = []
    for p in Path(out).glob(f"{benchmark}*.json"):
        try:
            rec = load_record(p)
        except (ValueError, json.JSONDecodeError):
            continue
        if rec["benchmark"] == benchmark and bool(rec.get("quick")) == quick:
            found.append((rec["date"], p))
    return [p for _, p in sorted(found, reverse=True)[:n]]


def compare_records(a: dict, b: dict) -> str:
    """What got faster or slower from ``a`` to ``b`` beyond the spread of either."""
    rows_a = {r["key"]: r for r in a["rows"]}
    faster, slower, same, only = [], [], 0, []
    for row in b["rows"]:
        old = rows_a.pop(row["key"], None)
        if old is None:
            only.append(f"  new in B: {row['key']}")
            continue
        unit = row.get("unit", "")
        # figures: times (lower is better) unless listed; ratios: speed-ups and
        # fractions of a limit (higher is better), robust to the machine's load
        higher = set(row.get("higher_is_better", ()))
        pairs = [
            (n, old["figures"].get(n), f, n in higher, unit) for n, f in row["figures"].items()
        ]
        pairs += [
            (f"ratio {n}", old.get("ratios", {}).get(n), f, True, "")
            for n, f in row.get("ratios", {}).items()
        ]
        for name, before, fig, up, unit in pairs:
            if before is None:
                continue
            sa, sb = Stats.from_dict(before), Stats.from_dict(fig)
            speedup = sb.median / sa.median if up else sa.median / sb.median
            line = (
                f"  {row['key']} | {name}: {sa.fmt('.4g')} -> {sb.fmt('.4g')} {unit} "
                f"({speedup:.2f}x{' higher' if up else ''})"
            )
            if sa.overlaps(sb):
                same += 1
            elif (sb.lo > sa.hi) == up:  # a time went down, or a rate or ratio up
                faster.append((speedup, line))
            else:
                slower.append((speedup, line))
    only += [f"  only in A: {k}" for k in rows_a]
    head = [
        f"A: {a['benchmark']} {a['date']} commit {a['commit']}{' (dirty)' if a.get('dirty') else ''}",
        f"B: {b['benchmark']} {b['date']} commit {b['commit']}{' (dirty)' if b.get('dirty') else ''}",
    ]
    ma, mb = a.get("machine", {}), b.get("machine", {})
    if ma.get("cpu_model") != mb.get("cpu_model") or ma.get("threads") != mb.get("threads"):
        head.append(
            f"note: different machines ({ma.get('cpu_model')} x{ma.get('threads')} vs "
            f"{mb.get('cpu_model')} x{mb.get('threads')})"
        )
    machine_moved = False
    for name, key in (("read bandwidth", "read_bw"), ("fp32 GEMM 1024^3", "gemm_fp32_1024")):
        if key in ma and key in mb:
            sa, sb = Stats.from_dict(ma[key]), Stats.from_dict(mb[key])
            head.append(f"{name}: {sa.scaled(1e-9).fmt('.1f')} -> {sb.scaled(1e-9).fmt('.1f')} G/s")
            machine_moved |= not sa.overlaps(sb)
    if ma.get("load_avg_1min") is not None and mb.get("load_avg_1min") is not None:
        head.append(f"1-min load average: {ma['load_avg_1min']:.2f} -> {mb['load_avg_1min']:.2f}")
    if machine_moved:
        head.append(
            "note: the machine's own figures moved beyond their spread (load?): times may "
            "have moved with it; the ratios (measured side by side) are the safer guide"
        )
    out = [*head, f"faster beyond the spread ({len(faster)}):"]
    out += [line for _, line in sorted(faster, reverse=True)]
    out += [f"slower beyond the spread ({len(slower)}):"]
    out += [line for _, line in sorted(slower)]
    out += [f"within the spread: {same} figures"]
    return "\n".join(out + only) + "\n"
