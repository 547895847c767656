"""Structured outputs and tool calls on the topg server against llama.cpp's ``llama-server``:
one run, same machine, same weights, same chat template file on both sides (topg's
``--chat-template FILE``, llama-server's ``--jinja --chat-template-file FILE``), the
official ``openai`` client, ``--concurrency`` requests in flight (16 by default).

Per system:

- **json**: every schema of the corpus (``tests/data/json_schemas.json``) with
  ``response_format`` json_schema, and the same prompts without a schema, as long as the
  model likes and each exactly as long as its schema answer (``ignore_eos``; the schema's
  cost is the ratio to these: the same tokens, prefills and batch occupancy, the masks
  the only difference; ``--repeats`` rounds of the two, the median ratio); completion
  tokens per second and the ratios; the share of
  ``"stop"`` answers that validate with ``jsonschema`` and the ``"length"`` share.
- **ttft**: first-token latency (streamed) of a request whose schema the server has never
  seen (a corpus schema with a fresh property name: a new grammar to compile) against
  the same request without a schema; p50 of each and their difference, idle (one
  request at a time) and under load (``--concurrency - 1`` plain requests running).
- **tools**: tool-call round trips per second with ``--concurrency`` clients: a request
  with ``tools`` and ``tool_choice: "required"``, then the tool's result sent back and
  the answer read; a round trip counts when the call parsed and named the tool.

Targets (the structured-outputs issue): json throughput >= 0.95x the same server without
a schema (the same lengths) and >= 1.0x llama-server's; 100% of "stop" answers valid, "length" <= 5%; the
schema's first-token latency within 50 ms of the plain one (p50), idle and loaded.

    python python/benchmarks/serving_structured.py [--requests N] [--concurrency 16]
        [--repeats 3] [--phases json,ttft,tools] [--max-tokens 512] [--dtype fp32] [--systems topg,llama] [--model PATH --gguf FILE]
        [--json out.json]

``--requests N`` takes the first N schemas (and N TTFT samples and N round trips per
client level); ``--model``/``--gguf``: another model (a folder for topg, its GGUF for
llama-server; the real-size issue's 1B-shaped model for the masks' cost). Default:
SmolLM2-135M-Instruct, llama-server on the same GGUF converted to the dtype.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from engine_llama import gguf_for  # noqa: E402
from llama_cpp_build import LlamaCppUnavailable, ensure_llama_cpp  # noqa: E402
from serving import CTX_PER_SLOT, THREADS, TORCH_DTYPE, free_port, server  # noqa: E402
from structured_outputs import CORPUS, score  # noqa: E402

TEMPLATE = ROOT / "torch_topg" / "serve" / "templates" / "smollm2.jinja"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Riga"]


def topg_cmd(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "torch_topg", "serve", "--port", str(port),
           "--dtype", TORCH_DTYPE[args.dtype], "--max-batch-size", str(args.concurrency),
           "--max-model-len", str(CTX_PER_SLOT),  # llama-server's context per slot
           "--chat-template", str(args.template), "--log-level", "warning"]  # fmt: skip
    return cmd + (["--model", args.model] if args.model else [])


def llama_cmd(binary: Path, gguf: Path, args: argparse.Namespace, port: int) -> list[str]:
    c = args.concurrency
    return [str(binary), "-m", str(gguf), "--parallel", str(c), "-c", str(CTX_PER_SLOT * c),
            "-t", str(THREADS), "-tb", str(THREADS), "--host", "127.0.0.1", "--port", str(port),
            "--no-webui", "--jinja", "--chat-template-file", str(args.template)]  # fmt: skip


def _schema_format(case: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema",
            "json_schema": {"name": case["name"], "schema": case["schema"], "strict": True}}  # fmt: skip


def json_phase(client: Any, model: str, corpus: list[dict], args: argparse.Namespace) -> dict:
    """The corpus with its schemas, then the same prompts without them twice: as long as
    the model likes (``plain``), and each exactly as long as its schema answer was
    (``plain_same_lengths``: ``max_tokens`` = that answer's tokens, ``ignore_eos``).
    Throughput, validity, "length" share. The schema's cost is the ratio to the same
    lengths: a schema answer is shorter, so the free-length pass has fewer prefills per
    token and a fuller batch at the end, which says nothing about the masks."""

    def one(case: dict[str, Any], schema: bool, tokens: int | None) -> dict[str, Any]:
        extra: dict[str, Any] = {"response_format": _schema_format(case)} if schema else {}
        if tokens is not None:
            extra["extra_body"] = {"ignore_eos": True}
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": case["prompt"]}],
            max_tokens=tokens or args.max_tokens, temperature=0, **extra,
        )  # fmt: skip
        c = r.choices[0]
        return {"name": case["name"], "finish_reason": c.finish_reason,
                "text": c.message.content or "", "tokens": r.usage.completion_tokens}  # fmt: skip

    def run(schema: bool, lengths: list[int | None]) -> tuple[dict[str, Any], list[dict]]:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda c, n: one(c, schema, n), corpus, lengths))
        wall = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in results)
        return {"wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall}, results

    out: dict[str, Any] = {}
    free: list[int | None] = [None] * len(corpus)
    out["plain"], _ = run(False, free)
    ratios: list[float] = []
    for r in range(args.repeats):  # greedy: every schema pass gives the same answers
        schema, results = run(True, free)
        same, _ = run(False, [max(1, x["tokens"]) for x in results])
        ratios.append(schema["tokens_per_s"] / same["tokens_per_s"])
        print(f"  round {r}: schema {schema['tokens_per_s']:.1f} tok/s, plain same lengths "
              f"{same['tokens_per_s']:.1f} ({ratios[-1]:.3f}x)", flush=True)  # fmt: skip
        if r == 0:
            out["schema"], out["plain_same_lengths"] = schema, same
            out["schema"].update(score(corpus, results))
        out.setdefault("rounds", []).append({"schema": schema, "plain_same_lengths": same})
    out["ratio_schema_to_plain"] = out["schema"]["tokens_per_s"] / out["plain"]["tokens_per_s"]
    out["ratio_schema_to_same_lengths"] = statistics.median(ratios)
    out["ratios_schema_to_same_lengths"] = ratios
    return out


def _fresh(case: dict[str, Any], k: int) -> dict[str, Any]:
    """``case`` with a property no schema had: a grammar the server has not compiled."""
    case = copy.deepcopy(case)
    case["name"] = f"{case['name']}_fresh{k}"
    schema = case["schema"]
    if schema.get("type") == "object":
        schema.setdefault("properties", {})[f"note_{os.getpid()}_{k}_{time.time_ns()}"] = {
            "type": "string"
        }
    else:  # wrap it: the same answer one level down
        case["schema"] = {"type": "object", "properties": {f"v{k}_{time.time_ns()}": schema}}
    return case


def _ttft(client: Any, model: str, case: dict[str, Any], schema: bool) -> float:
    extra = {"response_format": _schema_format(case)} if schema else {}
    t0 = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": case["prompt"]}], max_tokens=8,
        temperature=0, stream=True, **extra,
    )  # fmt: skip
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0) * 1000


def ttft_phase(client: Any, model: str, corpus: list[dict], args: argparse.Namespace) -> dict:
    """First-token latency, new schema against none, idle and under load."""
    out: dict[str, Any] = {}
    cases = [corpus[i % len(corpus)] for i in range(args.requests)]
    for loaded in (False, True):
        stop = [False]
        background = None
        if loaded and args.concurrency > 1:
            bg_pool = ThreadPoolExecutor(args.concurrency - 1)

            def busy(k: int) -> None:
                while not stop[0]:
                    client.chat.completions.create(
                        model=model, max_tokens=64, temperature=0,
                        messages=[{"role": "user", "content": corpus[k % len(corpus)]["prompt"]}],
                    )  # fmt: skip

            background = [bg_pool.submit(busy, k) for k in range(args.concurrency - 1)]
            time.sleep(1.0)  # the load is running
        try:
            plain = [_ttft(client, model, c, False) for c in cases]
            fresh = [_ttft(client, model, _fresh(c, k), True) for k, c in enumerate(cases)]
        finally:
            stop[0] = True
            if background is not None:
                for f in background:
                    f.result()
                bg_pool.shutdown()
        p50p, p50s = statistics.median(plain), statistics.median(fresh)
        out["loaded" if loaded else "idle"] = {
            "plain_ms": plain, "new_schema_ms": fresh, "plain_p50_ms": p50p,
            "new_schema_p50_ms": p50s, "difference_p50_ms": p50s - p50p,
        }  # fmt: skip
    return out


def tools_phase(client: Any, model: str, args: argparse.Namespace) -> dict:
    """Round trips (call, tool result, answer) per second with ``concurrency`` clients."""

    def trip(k: int) -> bool:
        city = CITIES[k % len(CITIES)]
        msgs: list[dict[str, Any]] = [
            {"role": "user", "content": f"What is the weather in {city}? Use the tool."}
        ]
        r = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER],
                                           tool_choice="required", max_tokens=64, temperature=0)  # fmt: skip
        calls = r.choices[0].message.tool_calls or []
        if not calls or calls[0].function.name != "get_weather":
            return False
        json.loads(calls[0].function.arguments)
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": calls[0].id, "type": "function", "function": {
                "name": "get_weather", "arguments": calls[0].function.arguments}}]})  # fmt: skip
        msgs.append({"role": "tool", "tool_call_id": calls[0].id,
                     "content": json.dumps({"city": city, "sky": "clear", "celsius": 21})})  # fmt: skip
        a = client.chat.completions.create(model=model, messages=msgs, tools=[WEATHER],
                                           max_tokens=48, temperature=0)  # fmt: skip
        return a.choices[0].finish_reason in ("stop", "length", "tool_calls")

    n = args.requests * args.concurrency
    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(lambda k: _safe(trip, k), range(n)))
    wall = time.perf_counter() - t0
    ok = sum(r is True for r in results)
    errors = [r for r in results if isinstance(r, str)][:5]
    return {"round_trips": n, "parsed": ok, "wall_s": wall, "round_trips_per_s": ok / wall,
            "errors": errors}  # fmt: skip


def _safe(fn: Any, k: int) -> bool | str:
    try:
        return fn(k)
    except Exception as e:  # a failed trip is counted, not fatal
        return f"{type(e).__name__}: {str(e)[:200]}"


def measure(name: str, url: str, corpus: list[dict], args: argparse.Namespace) -> dict:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    phases = {"json": lambda: json_phase(client, model, corpus, args),
              "ttft": lambda: ttft_phase(client, model, corpus, args),
              "tools": lambda: tools_phase(client, model, args)}  # fmt: skip
    res = {}
    for phase in args.phases.split(","):
        print(f"{name}: {phase} ...", flush=True)
        res[phase] = phases[phase]()
    return res


def save_record(results: dict[str, dict], notes: list[str], args: argparse.Namespace) -> None:
    """The run as a record of the benchmark harness (bench_results/serving_structured-
    <date>-<commit>.json): a row per system and phase, the phase's whole result in it."""
    from torch_topg.bench.machine import machine_info
    from torch_topg.bench.record import new_record, write_record
    from torch_topg.bench.timing import summarize

    rows = []
    for system, res in results.items():
        if "json" in res:
            j = res["json"]
            figures = {k: summarize([j[k]["tokens_per_s"]]).to_dict()
                       for k in ("plain", "schema", "plain_same_lengths")}  # fmt: skip
            ratios = {"schema / plain same lengths": summarize(
                j.get("ratios_schema_to_same_lengths", [j["ratio_schema_to_same_lengths"]])).to_dict()}  # fmt: skip
            rows.append({"key": f"{system} | json", "unit": "tokens/s", "figures": figures,
                         "ratios": ratios, "result": j})  # fmt: skip
        for phase in ("ttft", "tools"):
            if phase in res:
                rows.append({"key": f"{system} | {phase}", "figures": {}, "result": res[phase]})
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if v is not None]
    rec = new_record("serving_structured", rows, machine_info(), notes=notes, argv=argv)
    print(f"record {write_record(rec, args.out)}", flush=True)


def report(results: dict[str, dict]) -> str:
    lines = ["| figure | " + " | ".join(results) + " |", "|---|" + "---|" * len(results)]

    def row(label: str, get: Any) -> None:
        cells = []
        for r in results.values():
            try:
                cells.append(get(r))
            except (KeyError, TypeError):
                cells.append("-")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("json tok/s, round 0 (schema / plain, same lengths)", lambda r: f"{r['json']['schema']['tokens_per_s']:.1f} / "
        f"{r['json']['plain_same_lengths']['tokens_per_s']:.1f}")  # fmt: skip
    row("schema / plain same lengths, median of rounds [each]", lambda r: f"{r['json']['ratio_schema_to_same_lengths']:.3f}x ["
        + ", ".join(f"{x:.3f}" for x in r["json"].get("ratios_schema_to_same_lengths", [])) + "]")  # fmt: skip
    row("json tok/s (schema / plain, free lengths)", lambda r: f"{r['json']['schema']['tokens_per_s']:.1f} / "
        f"{r['json']['plain']['tokens_per_s']:.1f} ({r['json']['ratio_schema_to_plain']:.2f}x)")  # fmt: skip
    row("'stop' answers valid", lambda r: f"{r['json']['schema']['stop_valid_share']:.1%} of "
        f"{r['json']['schema']['stop']}")  # fmt: skip
    row("'length' share", lambda r: f"{r['json']['schema']['length_share']:.1%}")
    for k in ("idle", "loaded"):
        row(f"TTFT p50 new schema / none, {k} (ms)", lambda r, k=k: f"{r['ttft'][k]['new_schema_p50_ms']:.0f} / "
            f"{r['ttft'][k]['plain_p50_ms']:.0f} (+{r['ttft'][k]['difference_p50_ms']:.0f})")  # fmt: skip
    row("tool round trips/s (parsed/all)", lambda r: f"{r['tools']['round_trips_per_s']:.2f} "
        f"({r['tools']['parsed']}/{r['tools']['round_trips']})")  # fmt: skip
    if {"topg", "llama"} <= set(results):
        t, ll = results["topg"]["json"]["schema"], results["llama"]["json"]["schema"]
        lines.append(f"\njson-schema throughput topg / llama-server: "
                     f"{t['tokens_per_s'] / ll['tokens_per_s']:.2f}x")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=0, help="first N schemas (0: all)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="json rounds (schema, then plain at the same lengths; the median ratio)",
    )
    ap.add_argument("--phases", default="json,ttft,tools", help="which of json, ttft, tools")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--dtype", choices=sorted(TORCH_DTYPE), default="fp32")
    ap.add_argument("--systems", default="topg,llama")
    ap.add_argument("--model", default=None, help="topg's --model (default: SmolLM2)")
    ap.add_argument("--gguf", type=Path, default=None, help="llama-server's model file")
    ap.add_argument("--template", type=Path, default=TEMPLATE)
    ap.add_argument("--out", type=Path, default=ROOT / "bench_results")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    corpus = json.loads(CORPUS.read_text())
    if args.requests:
        corpus = corpus[: args.requests]
    else:
        args.requests = len(corpus)
    systems = args.systems.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    notes: list[str] = []
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    if "topg" in systems:
        port = free_port()
        cmd = topg_cmd(args, port)
        with server(cmd, port, args.out / "serving-structured-topg.log", env) as url:
            results["topg"] = {"cmd": cmd, **measure("topg", url, corpus, args)}
    if "llama" in systems:
        try:
            bins = ensure_llama_cpp()
            gguf = args.gguf or gguf_for(args.dtype, bins["llama-quantize"])
        except (LlamaCppUnavailable, RuntimeError) as e:
            notes.append(f"llama-server unavailable: {e}")
        else:
            port = free_port()
            cmd = llama_cmd(bins["llama-server"], gguf, args, port)
            with server(cmd, port, args.out / "serving-structured-llama.log") as url:
                results["llama"] = {"cmd": cmd, **measure("llama", url, corpus, args)}
    text = report(results)
    print(text)
    for n in notes:
        print("note:", n)
    save_record(results, notes, args)
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "results": results, "notes": notes}, indent=1))  # fmt: skip


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
