"""Structured outputs on the server: the JSON-schema corpus (tests/data/json_schemas.json)
through the official ``openai`` client on loopback, SmolLM2-135M-Instruct's real weights.

For every schema: one chat request with ``response_format`` json_schema (greedy,
``max_tokens``), ``--concurrency`` at a time. Reports the share of answers ending with
"stop" that validate with ``jsonschema`` (must be 100%), the share ending with "length",
the wall time, completion tokens a second, and the engine's mask figures
(``engine.stats()["structured"]``: fill time per step, the part the overlap hid).

    python python/benchmarks/structured_outputs.py [--max-tokens 512] [--concurrency 8]
        [--limit N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "data" / "json_schemas.json"


def run_corpus(client: Any, model: str, corpus: list[dict[str, Any]], max_tokens: int,
               concurrency: int) -> list[dict[str, Any]]:  # fmt: skip
    """One greedy chat request per schema; ``[{name, finish_reason, text, tokens}]``."""

    def one(case: dict[str, Any]) -> dict[str, Any]:
        r = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": case["prompt"]}],
            max_tokens=max_tokens,
            temperature=0,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True},
            },
        )
        c = r.choices[0]
        return {"name": case["name"], "finish_reason": c.finish_reason,
                "text": c.message.content, "tokens": r.usage.completion_tokens}  # fmt: skip

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, corpus))


def score(corpus: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Validity of the "stop" answers and the "length" share."""
    import jsonschema

    stopped = invalid = length = 0
    bad: list[str] = []
    long: list[str] = []
    for case, r in zip(corpus, results, strict=True):
        if r["finish_reason"] == "length":
            length += 1
            long.append(f"{case['name']}: {r['text'][:160]!r}...")
            continue
        stopped += 1
        try:
            jsonschema.validate(json.loads(r["text"]), case["schema"])
        except (ValueError, jsonschema.ValidationError):
            invalid += 1
            bad.append(case["name"])
    return {
        "requests": len(results),
        "stop": stopped,
        "stop_valid_share": (stopped - invalid) / stopped if stopped else 1.0,
        "invalid": bad,
        "length_share": length / len(results) if results else 0.0,
        "length_answers": long,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--limit", type=int, default=0, help="first N schemas only (0: all)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import openai
    import uvicorn

    from torch_topg.engine import Engine
    from torch_topg.serve import create_app

    corpus = json.loads(CORPUS.read_text())
    if args.limit:
        corpus = corpus[: args.limit]
    model = "smollm2"
    with Engine.from_pretrained(max_batch_size=args.concurrency, max_model_len=1024, seed=0) as eng:
        eng.wait_warm()  # the warm-up's background compile (engine.md)
        srv = uvicorn.Server(uvicorn.Config(create_app(eng, model), host="127.0.0.1", port=0,
                                            log_level="warning"))  # fmt: skip
        th = threading.Thread(target=srv.run, daemon=True)
        th.start()
        while not srv.started:
            time.sleep(0.02)
        port = srv.servers[0].sockets[0].getsockname()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
        t0 = time.perf_counter()
        results = run_corpus(client, model, corpus, args.max_tokens, args.concurrency)
        wall = time.perf_counter() - t0
        stats = eng.stats()["structured"]
        srv.should_exit = True
        th.join(timeout=10)
    report = score(corpus, results)
    tokens = sum(r["tokens"] for r in results)
    report.update(wall_s=wall, completion_tokens=tokens, tokens_per_s=tokens / wall,
                  max_tokens=args.max_tokens, concurrency=args.concurrency, mask=stats)  # fmt: skip
    print(f"{report['requests']} schemas, max_tokens={args.max_tokens}, "
          f"concurrency={args.concurrency}: {wall:.1f} s, {tokens} tokens ({tokens / wall:.1f}/s)")  # fmt: skip
    print(f"  'stop' answers valid: {report['stop_valid_share']:.1%} of {report['stop']}"
          f"{' invalid: ' + ', '.join(report['invalid']) if report['invalid'] else ''}")  # fmt: skip
    print(f"  'length' share: {report['length_share']:.1%}")
    for line in report["length_answers"]:
        print(f"    {line}")
    print(f"  mask per step: mean {stats['mask_ms_mean']:.3f} ms, p90 {stats['mask_ms_p90']:.3f} "
          f"ms, exposed {stats['mask_exposed_ms_mean']:.3f} ms (hidden "
          f"{stats['mask_hidden_fraction']:.0%}); applying {stats['apply_ms_mean']:.3f} ms")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
