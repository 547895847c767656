"""Command line:

``python -m torch_topg explain [--model NAME] [--dtype DTYPE] [--tokens N]`` prints what
``torch.compile(model, backend="topg")`` replaces in a model's prefill and decode graphs:
per pattern site replaced or not (and why), graph and graph-break counts.

``python -m torch_topg bench compare A.json B.json`` prints what got faster or slower
from benchmark record A to B beyond the spread of either (records: ``bench_results/``).

``python -m torch_topg bench serve --url URL [--concurrency 1,4,16] [--requests N]
[--dataset chat|random|shared-prefix]`` load-tests an OpenAI-compatible server (streamed
chat completions): request throughput, output tokens/s, TTFT / TPOT / ITL / end-to-end
percentiles, as a table and a record (``--json``).

``python -m torch_topg monitor URL [--interval S] [--once]`` is a live terminal view of a
running server, from its ``/metrics``.

``python -m torch_topg options [--write docs/engine.md]`` prints the engine's options as
the markdown table of docs/engine.md (``--write``: replaces that table in the file).

``python -m torch_topg tune [--out PATH] [--ops a,b] [--quick] [--dry-run]`` measures every
implementation of the ops dispatched on CUDA (attention, paged_attention, fused_moe, linear)
on this GPU and writes the tuning table (docs/gpu.md, "Dispatch"); ``--dry-run`` lists the
shapes without a GPU.

``python -m torch_topg serve [--model M] [--host H] [--port P] [engine options]`` serves
the model over an OpenAI-compatible HTTP API (the ``serve`` extra; ``serve --help``,
docs/serve.md); with ``--replicas N``, N engines behind one endpoint on Ray Serve (the
``cluster`` extra, docs/cluster.md).
"""

from __future__ import annotations

import argparse
import sys

import torch


def _load(name: str, dtype: torch.dtype, experts: str | None):
    from torch_topg.models import MODEL_PRESETS, build_model, load_smollm2

    kw = {"experts_implementation": experts} if experts else {}
    if name == "smollm2":
        return load_smollm2(dtype, **kw)[0]
    if name not in MODEL_PRESETS:
        raise SystemExit(f"unknown model {name!r}: smollm2 or one of {sorted(MODEL_PRESETS)}")
    return build_model(name, dtype, **kw)


def explain_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_topg explain")
    p.add_argument("--model", default="smollm2", help="smollm2 or a torch_topg.models preset")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--tokens", type=int, default=16, help="prompt length of the prefill")
    p.add_argument("--experts", default=None, help="experts_implementation for MoE models")
    args = p.parse_args(argv)
    import torch_topg

    model = _load(args.model, getattr(torch, args.dtype), args.experts)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    print(f"== {args.model} {args.dtype}: prefill of {args.tokens} tokens")
    print(torch_topg.explain(model, input_ids=ids, use_cache=True).summary())
    with torch.inference_mode():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    print(f"\n== {args.model} {args.dtype}: one decode step after it")
    print(torch_topg.explain(model, input_ids=ids[:, -1:], past_key_values=cache).summary())
    return 0


def bench_main(argv: list[str]) -> int:
    if argv[:1] == ["serve"]:  # its own parser (serve --help)
        from torch_topg.client.loadgen import serve_bench_main

        return serve_bench_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m torch_topg bench")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("serve", help="load-test an OpenAI-compatible server (serve --help)")
    c = sub.add_parser("compare", help="what changed from record A to B beyond the spread")
    c.add_argument("a")
    c.add_argument("b")
    args = p.parse_args(argv)
    from torch_topg.bench import compare_records, load_record

    try:
        a, b = load_record(args.a), load_record(args.b)
    except (OSError, ValueError) as exc:
        print(f"cannot read a record: {exc}", file=sys.stderr)
        return 2
    print(compare_records(a, b), end="")
    return 0


def options_main(argv: list[str]) -> int:
    from torch_topg.engine.options import markdown_table, rewrite_table

    p = argparse.ArgumentParser(prog="python -m torch_topg options")
    p.add_argument("--write", metavar="FILE", help="replace the options table in FILE")
    args = p.parse_args(argv)
    if args.write is None:
        print(markdown_table())
        return 0
    with open(args.write) as f:
        text = rewrite_table(f.read())
    with open(args.write, "w") as f:
        f.write(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "explain":
        return explain_main(argv[1:])
    if argv[0] == "bench":
        return bench_main(argv[1:])
    if argv[0] == "monitor":
        from torch_topg.client.monitor import monitor_main

        return monitor_main(argv[1:])
    if argv[0] == "options":
        return options_main(argv[1:])
    if argv[0] == "tune":
        from torch_topg.ops.dispatch.tune import main as tune_main

        return tune_main(argv[1:])
    if argv[0] == "serve":
        from torch_topg.serve.cli import parser, serve_main

        if parser().parse_known_args(argv[1:])[0].replicas is not None:
            from torch_topg.cluster.deploy import serve_cluster

            return serve_cluster(argv[1:])
        return serve_main(argv[1:])
    print(f"unknown command {argv[0]!r}\n{__doc__}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
