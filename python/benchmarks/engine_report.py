"""The engine benchmark's tables and record: rows from the workers' results,
the Markdown, the ``torch_topg.bench`` record."""

from __future__ import annotations

import statistics
from pathlib import Path

from engine_common import (
    CONCURRENCY,
    DECODE_CONTEXT,
    DECODE_TOKENS,
    MAX_MODEL_LEN,
    TTFT_PROMPT,
    med,
    pct,
)

from torch_topg.bench.models import round_flops


def agreement(
    ref: list[list[int]] | None, other: list[list[int]] | None, eos: frozenset[int] = frozenset()
) -> str:
    """Identical greedy sequences out of 16 and the mean common prefix length; and how
    many of the first differences are an EOS that ``ref`` emitted and ``other`` did not
    (the engine's and transformers' continuous batching ``ignore_eos`` keep generating
    after an EOS they sample, vLLM's meaning; ``min_new_tokens`` in transformers
    ``generate`` and llama.cpp's ``ignore_eos`` ban EOS, so they take the runner-up)."""
    if not ref or not other or len(ref) != len(other):
        return "-"
    same = sum(a == b for a, b in zip(ref, other, strict=True))
    pref, at_eos = [], 0
    for a, b in zip(ref, other, strict=True):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        pref.append(k)
        if k < min(len(a), len(b)) and a[k] in eos and b[k] not in eos:
            at_eos += 1
    out = f"{same}/{len(ref)} (prefix {statistics.mean(pref):.0f})"
    if same < len(ref) and eos:
        out += f"; {at_eos} of {len(ref) - same} first differ where the engine emitted EOS"
    return out


def throughput_rows(r: dict, shape: dict, gemm: float, new_tokens: int) -> list[dict]:
    flops = round_flops(shape, r["prompt_lens"], new_tokens)
    rows = []
    eng = r.get("engine", {})
    eng_tokens = eng.get("tokens") if "error" not in eng else None
    names = {
        "engine": "torch_topg Engine (16 submitted at once)",
        "hf-cb": "transformers `generate_batch` (continuous batching)",
        "hf-generate": "transformers `generate` (padded batch of 16, eager)",
        "llama-server": "llama.cpp `llama-server --parallel 16`",
    }
    for key, label in names.items():
        x = r.get(key)
        if x is None:
            continue
        if "error" in x:
            rows.append({"label": label, "error": x["error"]})
            continue
        if key == "engine":
            walls = [q["wall_s"] for q in x["rounds"]]
            toks = x["rounds"][0]["tokens"]
        else:
            walls, toks = x["walls_s"], x["tokens_per_round"]
        rate = med([toks / w for w in walls])
        rows.append(
            {
                "label": label,
                "key": key,
                "tok_s": rate,
                "wall_s": statistics.median(walls),
                "gflops": flops / statistics.median(walls) / 1e9,
                "of_peak": flops / statistics.median(walls) / gemm,
                "agree": "reference"
                if key == "engine"
                else agreement(eng_tokens, x.get("tokens"), frozenset(r.get("eos_ids", []))),
                "peak_rss_mb": x.get("peak_rss_mb"),
                "problems": x.get("problems", []),
            }
        )
    return rows


def fmt_m(m: dict, f: str = "{:.1f}") -> str:
    if m["n"] == 1:
        return f.format(m["median"]) + " (n=1)"
    return f"{f.format(m['median'])} [{f.format(m['min'])}-{f.format(m['max'])}] (n={m['n']})"


def render(results: list[dict], meta: dict, shape: dict) -> tuple[str, str]:
    gemm = meta["gemm_flops"]
    nt = meta["new_tokens"]
    L = [
        "# torch_topg Engine benchmark",
        "",
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}; torch {meta['torch']}; transformers {meta['transformers']}; "
        f"{meta['threads']} threads; CPU: {meta['cpu']}",
        f"- torch_topg at {meta.get('commit', '?')}\n"
        f"- model: SmolLM2-135M-Instruct (same weights in every system); llama.cpp: "
        f"{meta['llama']}",
        f"- fp32 GEMM rate of torch (1024^3, `torch_topg.bench.gemm_rate`), measured "
        f"before every system in this run: best {gemm / 1e9:.1f} GFLOP/s (the reference for the "
        f"FLOP rates), worst {meta.get('gemm_min', gemm) / 1e9:.1f}; a low one means another "
        "process had the cores (the machine is shared).",
        f"- FLOPs of a round: sum over requests of 2 * N * T + 4 * L * H * d * T(T+1)/2 with "
        f"T = P + {nt} - 1 positions passed through the model (P = prompt tokens), "
        f"N = {shape['params_non_embedding'] / 1e6:.1f}M non-embedding parameters, L = "
        f"{shape['layers']}, H = {shape['heads']} query heads, d = {shape['head_dim']}; the "
        f"tied LM head ({shape['params_embedding'] / 1e6:.1f}M, another "
        f"{shape['params_embedding'] / shape['params_non_embedding']:.0%} of the per-token "
        "matmul work) is not counted.",
        "- `a [b-c] (n=k)`: median, min-max over k repeated measurements.",
        "",
    ]
    summary = []
    for r in results:
        dt = r["dtype"]
        L += [
            f"## {dt}",
            "",
            f"### (a) Throughput: {CONCURRENCY} chat requests (prompts "
            f"{min(r['prompt_lens'])}-{max(r['prompt_lens'])} tokens, "
            f"{sum(r['prompt_lens'])} in all), {nt} new tokens each, greedy, EOS ignored",
            "",
            "| system | output tokens/s | round wall s | GFLOP/s | of measured fp32 GEMM rate | "
            "engine tokens/s over this | greedy tokens identical to engine's | peak RSS MB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        rows = throughput_rows(r, shape, gemm, nt)
        eng_rate = next((x["tok_s"]["median"] for x in rows if x.get("key") == "engine"), None)
        for x in rows:
            if "error" in x:
                first = x["error"].strip().splitlines()[0] if x["error"].strip() else "error"
                L.append(f"| {x['label']} | not measured: {first[:200]} | | | | | | |")
                continue
            vs = f"{eng_rate / x['tok_s']['median']:.2f}x" if eng_rate else "-"
            L.append(
                f"| {x['label']} | {fmt_m(x['tok_s'])} | {x['wall_s']:.2f} | {x['gflops']:.2f} | "
                f"{x['of_peak']:.1%} | {vs if x['key'] != 'engine' else '1'} | {x['agree']} | "
                f"{x['peak_rss_mb']:.0f} |"
            )
            for p in x["problems"]:
                L.append(f"|  | problem: {p} | | | | | | |")
        if r.get("checks"):
            L += [
                "",
                "Machine check before each system (torch fp32 GEMM GFLOP/s / 1-min load "
                "average): "
                + "; ".join(
                    f"{k} {c['gemm'] / 1e9:.0f} / {c['load1']:.1f}" for k, c in r["checks"].items()
                )
                + ".",
            ]
        e = r.get("engine", {})
        if "rounds" in e:
            ttfts = [t * 1e3 for q in e["rounds"] for t in q["ttft_s"]]
            mb = statistics.mean(q["mean_batch"] for q in e["rounds"])
            comp = [q["computed"] for q in e["rounds"]]
            L += [
                "",
                f"Engine: mean batch size {mb:.2f} (sequences per step, prefill chunks "
                f"included; {statistics.median(q['steps'] for q in e['rounds']):.0f} steps a "
                f"round); TTFT p50 {pct(ttfts, 0.5):.0f} ms, p90 {pct(ttfts, 0.9):.0f} ms "
                f"(n={len(ttfts)}: {len(e['rounds'])} rounds x {CONCURRENCY}); tokens computed "
                f"a round {comp[0]} (= prompts + {CONCURRENCY} x {nt - 1}: "
                f"{sum(r['prompt_lens']) + CONCURRENCY * (nt - 1)}, no prefix reuse); "
                f"compilations while serving: {e['compile'].get('while_serving')}; load + "
                f"compile {e['load_s']:.0f} s.",
            ]
        b = r.get("engine-batch1", {})
        lb = r.get("llama-bench", {})
        L += [
            "",
            "### (b) Batch 1",
            "",
            "| measure | engine ms | llama.cpp ms | engine / llama.cpp (time) |",
            "|---|---|---|---|",
        ]
        for key, label in (
            ("decode_ms", f"decode ms/token at context {DECODE_CONTEXT} ({DECODE_TOKENS} tokens)"),
            ("ttft_ms", f"TTFT, {TTFT_PROMPT}-token prompt"),
        ):
            ev = fmt_m(b[key], "{:.2f}") if key in b else _err(b)
            lv = fmt_m(lb[key], "{:.2f}") if key in lb else _err(lb)
            ratio = (
                f"{b[key]['median'] / lb[key]['median']:.2f}x" if key in b and key in lb else "-"
            )
            L.append(f"| {label} | {ev} | {lv} | {ratio} |")
        if "decode_ms_cmd" in lb:
            L += [
                "",
                f"llama.cpp: `{Path(lb['decode_ms_cmd'].split()[0]).name} "
                f"{' '.join(lb['decode_ms_cmd'].split()[1:])}` (tg{DECODE_TOKENS} at depth "
                f"{DECODE_CONTEXT}, ms per token) and `... {' '.join(lb['ttft_ms_cmd'].split()[-4:])}`"
                f" (pp{TTFT_PROMPT}: prompt processing only, no sampling); flash_attn="
                f"{lb.get('flash_attn')}. Engine: a new random prompt each time; decode = "
                "(last token time - first token time) / 63; TTFT = first token time from "
                "submit (scheduling, prefill, sampling).",
            ]
        L += ["", "### (c) Memory (each system its own process, peak = VmHWM)", ""]
        hg = r.get("hf-generate", {})
        L += [
            "| system | RSS after load MB | peak RSS MB | RSS after each round MB |",
            "|---|---|---|---|",
        ]
        if "rounds" in e:
            L.append(
                f"| engine | {e['rss_load_mb']:.0f} | {e['peak_rss_mb']:.0f} | "
                f"{', '.join(f'{v:.0f}' for v in e['rss_after_rounds_mb'])} (warm-up first) |"
            )
        for key, label in (
            ("hf-generate", "transformers generate (eager)"),
            ("hf-cb", "transformers generate_batch"),
        ):
            x = r.get(key, {})
            if "peak_rss_mb" in x:
                L.append(
                    f"| {label} | {x.get('rss_load_mb', float('nan')):.0f} | {x['peak_rss_mb']:.0f} |"
                    f" {x['rss_after_mb']:.0f} (end) |"
                )
        ls = r.get("llama-server", {})
        if "peak_rss_mb" in ls:
            L.append(
                f"| llama-server | {ls['rss_load_mb']:.0f} | {ls['peak_rss_mb']:.0f} | "
                f"{', '.join(f'{v:.0f}' for v in ls['rss_after_rounds_mb'])} |"
            )
        if "rounds" in e and "peak_rss_mb" in hg:
            bound = hg["peak_rss_mb"] + e["kv_bytes"] / 2**20 + 150
            ok = e["peak_rss_mb"] <= bound
            L += [
                "",
                f"Engine peak {e['peak_rss_mb']:.0f} MB vs transformers eager peak "
                f"{hg['peak_rss_mb']:.0f} MB + configured KV pool {e['kv_bytes'] / 2**20:.0f} MB "
                f"({e['kv_blocks']} blocks, max_model_len {MAX_MODEL_LEN}, 16 slots) + 150 MB = "
                f"{bound:.0f} MB: {'within' if ok else 'OVER'}.",
            ]
        kvr = e.get("kv_resident_mb") or []
        if "rounds" in e and kvr and all(v is not None for v in kvr):
            rss = e["rss_after_rounds_mb"]
            rest = [a - b for a, b in zip(rss, kvr, strict=True)]
            grew = kvr[-1] - kvr[1]
            why = (
                "flat: the rounds reuse the blocks the warm-up round wrote"
                if abs(grew) < 8
                else f"{grew:+.0f} MB: rounds wrote pool blocks never written before (the pool "
                "is torch.empty, its pages commit on first write), bounded by the pool size"
            )
            L += [
                "",
                "Engine RSS after each round (warm-up first), split by mincore into the KV "
                f"pool's resident pages and the rest: KV {', '.join(f'{v:.0f}' for v in kvr)} "
                f"MB; rest {', '.join(f'{v:.0f}' for v in rest)} MB. From round 1 to round "
                f"{len(rest) - 1} the rest changes by {rest[-1] - rest[1]:+.0f} MB and the "
                f"resident KV by {why}.",
            ]
        L.append("")
        # summary
        rows_ok = {x["key"]: x for x in rows if "key" in x}
        s = [f"{dt}:"]
        if "engine" in rows_ok:
            s.append(
                f"  engine {rows_ok['engine']['tok_s']['median']:.1f} tok/s "
                f"({rows_ok['engine']['gflops']:.1f} GFLOP/s, {rows_ok['engine']['of_peak']:.0%} of GEMM peak)"
            )
        for k in ("hf-cb", "hf-generate", "llama-server"):
            if k in rows_ok:
                s.append(
                    f"  {k} {rows_ok[k]['tok_s']['median']:.1f} tok/s (engine "
                    f"{eng_rate / rows_ok[k]['tok_s']['median']:.2f}x)"
                    if eng_rate
                    else f"  {k} {rows_ok[k]['tok_s']['median']:.1f} tok/s"
                )
        for key in ("decode_ms", "ttft_ms"):
            if key in b and key in lb:
                s.append(
                    f"  batch-1 {key}: engine {b[key]['median']:.2f} vs llama.cpp "
                    f"{lb[key]['median']:.2f} ({b[key]['median'] / lb[key]['median']:.2f}x)"
                )
        if "rounds" in e:
            s.append(
                f"  engine peak RSS {e['peak_rss_mb']:.0f} MB; RSS after rounds "
                f"{', '.join(f'{v:.0f}' for v in e['rss_after_rounds_mb'])}"
            )
        summary.append("\n".join(s))
    notes = [f"- {k}: {v}" for k, v in meta.get("notes", {}).items()]
    if notes:
        L += ["## Notes", "", *notes, ""]
    return "\n".join(L), "\n".join(summary)


def _err(x: dict) -> str:
    if "error" in x:
        return "not measured: " + x["error"].strip().splitlines()[0][:160]
    return "-"


def to_record(results: list[dict], meta: dict, quick: bool) -> dict:
    """The run as a ``torch_topg.bench`` record: one row per (dtype, system), its
    repeated figures (``med`` dicts) as Stats; tokens/s are higher-is-better."""
    from torch_topg.bench import machine_info, new_record

    rows = []
    for r in results:
        for system, v in r.items():
            if not isinstance(v, dict) or system == "checks":
                continue
            figs = {k: x for k, x in v.items() if isinstance(x, dict) and "spread" in x}
            if figs:
                rows.append({
                    "key": f"{system} | {r['dtype']}", "unit": "as named",
                    "figures": {k: {f: x[f] for f in ("median", "lo", "hi", "n", "spread")}
                                for k, x in figs.items()},
                    "higher_is_better": [k for k in figs if "tok_s" in k or "per_s" in k],
                })  # fmt: skip
    notes = [f"{k}: {v}" for k, v in meta.get("notes", {}).items()]
    return new_record("engine", rows, machine_info(), quick=quick, notes=notes)
