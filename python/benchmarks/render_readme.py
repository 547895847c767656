"""Rewrite the generated benchmark tables of the docs from the records.

    python python/benchmarks/render_readme.py                  # newest records in bench_results/
    python python/benchmarks/render_readme.py --ops A.json B.json C.json
    python python/benchmarks/render_readme.py --check          # exit 1 if a block is stale

Each generated block sits between ``<!-- bench:NAME:begin -->`` and
``<!-- bench:NAME:end -->``; only the text between the markers is replaced, nothing else
in the file is touched. A block is rewritten in every file of its list that holds its
markers (``BLOCKS``); where none does, it is left out. Blocks and the pages that hold them:

* ``ops-targets`` (docs/ops.md; README.md may hold it too): one line per ops run (targets
  met, within noise, in cache, the largest fraction of a limit), then the latest run's
  targeted rows.
* ``ops-all`` (docs/benchmarks.md): every row of the latest ops run.
* ``models`` (docs/benchmarks.md): the latest ``bench_models.py`` record's table.
* ``eager-enable`` (docs/integrations.md), ``offload`` (docs/offload.md), ``tp``
  (docs/parallel.md): the latest record of ``eager_enable.py``, ``offload.py``, ``tp.py``.

Links in a block are written relative to the file that holds it. It also redraws
``docs/bench_cpu.png`` (the ops plot in docs/benchmarks.md) from the newest ops record.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))

from torch_topg.bench import latest, load_record  # noqa: E402


class MissingBlock(LookupError):
    pass


def replace_block(text: str, name: str, body: str) -> str:
    """``text`` with the block ``name`` replaced by ``body``; ``MissingBlock`` if absent."""
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise MissingBlock(f"no block {name!r} (markers {begin} ... {end})")
    return pattern.sub(lambda _: f"{begin}\n{body.strip()}\n{end}", text, count=1)


def ops_runs_line(rec: dict) -> str:
    from bench_ops import Row, summary

    rows = [Row.from_dict(d) for d in rec["rows"]]
    return f"- {rec['date']}, commit {rec['commit']}: {summary(rows)}"


def _command(rec: dict) -> str:
    argv = list(rec.get("argv") or ["python/benchmarks/bench_ops.py"])
    script = Path(argv[0])
    if script.is_absolute() and script.is_relative_to(ROOT):
        argv[0] = str(script.relative_to(ROOT))
    return "python " + " ".join(argv)


def _link(target: str, into: str) -> str:
    """``target`` (a path from the repository root) as a link from the file ``into``."""
    return os.path.relpath(target, os.path.dirname(into) or ".")


def ops_targets(recs: list[dict], into: str) -> str:
    from bench_ops import render

    n = len(recs)
    bench = _link("docs/benchmarks.md", into)
    lines = [
        f"Command: `{_command(recs[0])}`; {n} run{'s' if n > 1 else ''}, one record each "
        "in `bench_results/`. This block is written from the records by "
        "`python python/benchmarks/render_readme.py`; how the figures are made (interleaved "
        'rounds, median [spread], per-round ratios, "in cache", cold rotation, the '
        f"limits) is in [benchmarks.md]({bench}). A target is met when the "
        'ratio\'s median meets it; "within noise": the spread holds the target.',
        "",
        *[ops_runs_line(r) for r in recs],
        "",
        "The latest run's rows that carry one of the op library's targets (all rows: "
        f"[benchmarks.md]({bench})):",
        "",
        render(recs[0], targets_only=True),
    ]
    return "\n".join(lines)


def ops_all(recs: list[dict], into: str) -> str:
    from bench_ops import render

    return render(recs[0])


def models(recs: list[dict], into: str) -> str:
    from bench_models import render_record

    return render_record(recs[0])


def eager_enable(recs: list[dict], into: str) -> str:
    from eager_enable import render_record

    return render_record(recs[0])


def offload(recs: list[dict], into: str) -> str:
    from offload import render_record

    return render_record(recs[0])


def tp(recs: list[dict], into: str) -> str:
    from tp import render_record

    return render_record(recs[0])


# block -> (files that may hold it, benchmark, how many records, render(records, file))
BLOCKS = {
    "ops-targets": (("docs/ops.md", "README.md"), "ops", 3, ops_targets),
    "ops-all": (("docs/benchmarks.md",), "ops", 1, ops_all),
    "models": (("docs/benchmarks.md", "README.md"), "models", 1, models),
    "eager-enable": (("docs/integrations.md", "README.md"), "eager_enable", 1, eager_enable),
    "offload": (("docs/offload.md", "README.md"), "offload", 1, offload),
    "tp": (("docs/parallel.md", "README.md"), "tp", 1, tp),
}


def _holds(path: Path, block: str) -> bool:
    text = path.read_text()
    return f"<!-- bench:{block}:begin -->" in text and f"<!-- bench:{block}:end -->" in text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "bench_results"))
    ap.add_argument("--ops", nargs="*", help="ops records, newest first (default: newest 3)")
    ap.add_argument("--models", nargs="*", help="a bench_models record")
    ap.add_argument(
        "--record", nargs=2, action="append", metavar=("BENCHMARK", "FILE"),
        help="use FILE for BENCHMARK (eager_enable, offload, tp), e.g. --record tp tp.json",
    )  # fmt: skip
    ap.add_argument("--root", default=str(ROOT), help="where README.md and docs/ are")
    ap.add_argument("--check", action="store_true", help="exit 1 if a block would change")
    ap.add_argument("--no-plot", action="store_true", help="leave docs/bench_cpu.png as it is")
    args = ap.parse_args(argv)
    given = {"ops": args.ops, "models": args.models, **{b: [f] for b, f in args.record or []}}
    stale, root = [], Path(args.root)
    for block, (files, bench, n, fn) in BLOCKS.items():
        held = [f for f in files if (root / f).is_file() and _holds(root / f, block)]
        if not held:
            print(f"{block}: no markers in {', '.join(files)}; left out")
            continue
        paths = given.get(bench) or latest(args.results, bench, n=n)
        if not paths:
            print(f"{block}: no {bench} record under {args.results}; left as it is")
            continue
        recs = sorted((load_record(p) for p in paths), key=lambda r: r["date"], reverse=True)
        for file in held:
            path = root / file
            text = path.read_text()
            new = replace_block(text, block, fn(recs, file))
            if new != text:
                stale.append(f"{file}:{block}")
                if not args.check:
                    path.write_text(new)
            print(f"{file}: {block} from {', '.join(str(p) for p in paths)}")
    ops = given["ops"] or latest(args.results, "ops", n=1)
    if ops and not args.check and not args.no_plot:
        from bench_ops import Row, plot

        newest = max((load_record(p) for p in ops), key=lambda r: r["date"])
        plot([Row.from_dict(d) for d in newest["rows"]], root / "docs" / "bench_cpu.png")
        print(f"docs/bench_cpu.png from the record of {newest['date']}")
    if args.check and stale:
        print("stale blocks:", ", ".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
