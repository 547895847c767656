"""GPU benchmarks of the CUDA kernels against the issue's targets (run by gpu_suite.sh).

    python3 python/benchmarks/gpu/bench_gpu.py [--quick] [--md results.md] [--json r.json]

Timing: CUDA events around each call, warm-up first, the median of the repeats. topg's
ops with index checks (paged_attention, rotary_embedding, fused_moe) are timed as CUDA
graph replays (the checks' device sync steps aside, as in a graphed decode loop); their
plain eager call, checks included, is reported too ("topg eager"). The
physical limit is the device-to-device copy bandwidth measured in the same run (bytes
read + written over time), so "% BW" = (bytes the op must move / time) / copy bandwidth.

Rows and targets (from the CUDA issue):
  paged_attention decode, ctx 2k..16k      >= 75 % of copy bandwidth
  attention prefill vs SDPA flash, S 2k..8k >= 0.8 x SDPA (time ratio sdpa / topg)
  fused_moe, batch <= 64                    >= 5 x the eager expert loop, >= 1.5 x grouped_mm
  rms_norm, rotary_embedding, large         >= 80 % of copy bandwidth
The two MoE baselines are plain-torch emulations of transformers' experts implementations:
``eager`` (a Python loop over the experts that were hit, as MixtralExperts does) and
``grouped_mm`` (tokens sorted by expert, then torch._grouped_mm for both products, as
transformers' grouped_mm experts implementation does); emulated so that the benchmark does
not depend on transformers' private module layout.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

import torch_topg
from torch_topg import _native
from torch_topg.bench import bench

DEV = "cuda"
ROWS: list[dict] = []


def cuda_ms(fn: Callable[[], object], warmup: int = 5, reps: int = 30) -> float:
    """Median time of fn() in ms, each call timed with its own pair of CUDA events
    (``torch_topg.bench.bench`` with ``device="cuda"``)."""
    t = bench(fn, warmup=warmup, min_runs=reps, max_runs=reps, min_time_s=0.0, device=DEV)
    return t.median_ms


def graph_ms(fn: Callable[[], object], reps: int = 30) -> float:
    """Median time of one replay of fn() captured in a CUDA graph. topg's host-side index
    checks (one sync per call) step aside during capture, as in a graphed decode loop."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # warm-up outside the capture (allocator, first-call set-up)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return cuda_ms(graph.replay, reps=reps)


def copy_bandwidth() -> float:
    """Device-to-device copy of 2 GiB: bytes read + written per second."""
    x = torch.empty(1 << 30, dtype=torch.int16, device=DEV)
    y = torch.empty_like(x)
    ms = cuda_ms(lambda: y.copy_(x), warmup=3, reps=20)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def row(op, case, topg_ms, baselines, *, bw_bytes=None, target=None, note=""):
    r = {"op": op, "case": case, "topg_ms": topg_ms, "baselines": baselines, "note": note}
    if bw_bytes is not None:
        r["bw_pct"] = 100 * bw_bytes / (topg_ms * 1e-3) / BW
    if target is not None:
        name, minimum = target
        got = r["bw_pct"] / 100 if name == "bw" else baselines[name] / topg_ms
        r["target"], r["ratio"], r["ok"] = f"{name} >= {minimum}", got, got >= minimum
    ROWS.append(r)
    print(json.dumps(r), flush=True)


def bench_paged(quick: bool) -> None:
    ns, hq, hkv, d, bs = 32, 32, 8, 128, 16
    for ctx in [2048, 8192] if quick else [2048, 4096, 8192, 16384]:
        blocks = ns * ctx // bs
        kc = torch.randn(blocks, bs, hkv, d, device=DEV, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        bt = torch.randperm(blocks, device=DEV, dtype=torch.int32).view(ns, ctx // bs)
        sl = torch.full((ns,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(ns, hq, d, device=DEV, dtype=torch.bfloat16)
        nbytes = 2 * kc.numel() * kc.element_size()  # K and V read once
        call = lambda: torch_topg.ops.paged_attention(q, kc, vc, bt, sl)  # noqa: E731
        t, eager = graph_ms(call), cuda_ms(call)
        case = f"B={ns} ctx={ctx} Hq={hq} Hkv={hkv} D={d} bs={bs} bf16"
        row("paged_attention", case, t, {"topg eager": eager}, bw_bytes=nbytes, target=("bw", 0.75))


def bench_prefill(quick: bool) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, d = 1, 32, 128
    for s in [2048, 8192] if quick else [2048, 4096, 8192]:
        q, k, v = (torch.randn(b, h, s, d, device=DEV, dtype=torch.bfloat16) for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [B, S, H, D] views, no copy

        def sdpa(q=q, k=k, v=v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        t_sdpa = cuda_ms(sdpa, reps=10)
        t = cuda_ms(lambda: torch_topg.ops.attention(qt, kt, vt, causal=True), reps=10)
        case = f"B={b} S={s} H={h} D={d} causal bf16"
        row("attention", case, t, {"sdpa_flash": t_sdpa}, target=("sdpa_flash", 0.8))


def moe_eager(x, wgu, wd, w, ids):
    """transformers' eager experts: a loop over the experts that were hit."""
    out = torch.zeros_like(x)
    inter = wd.shape[-1]
    hit = torch.unique(ids).tolist()
    for e in hit:
        tok, slot = torch.where(ids == e)
        gu = x[tok] @ wgu[e].T
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, tok, (h @ wd[e].T) * w[tok, slot, None].to(x.dtype))
    return out


def moe_grouped_mm(x, wgu, wd, w, ids):
    """transformers' grouped_mm experts: sort by expert, torch._grouped_mm twice."""
    k, inter = ids.shape[1], wd.shape[-1]
    flat = ids.reshape(-1)
    order = flat.argsort()
    counts = torch.bincount(flat, minlength=wgu.shape[0])
    offs = counts.cumsum(0).to(torch.int32)
    xs = x[order // k]
    gu = torch._grouped_mm(xs, wgu.transpose(1, 2), offs=offs)
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch._grouped_mm(h, wd.transpose(1, 2), offs=offs)
    y = y * w.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, order // k, y)


def bench_moe(quick: bool) -> None:
    configs = [("mixtral", 8, 2, 4096, 14336), ("qwen3-moe", 128, 8, 2048, 768)]
    for name, e, k, hdim, inter in configs[:1] if quick else configs:
        wgu = torch.randn(e, 2 * inter, hdim, device=DEV, dtype=torch.bfloat16) / hdim**0.5
        wd = torch.randn(e, hdim, inter, device=DEV, dtype=torch.bfloat16) / inter**0.5
        for batch in [1, 16, 64] if quick else [1, 4, 16, 32, 64]:
            x = torch.randn(batch, hdim, device=DEV, dtype=torch.bfloat16)
            logits = torch.randn(batch, e, device=DEV)
            w, ids = torch_topg.ops.moe_topk(logits, k, renormalize=True)
            args = (x, wgu, wd, w, ids)
            call = lambda args=args: torch_topg.ops.fused_moe(*args)  # noqa: E731
            t = graph_ms(call)
            base = {"topg eager": cuda_ms(call)}
            base["eager"] = cuda_ms(lambda args=args: moe_eager(*args), reps=10)
            try:
                base["grouped_mm"] = cuda_ms(lambda args=args: moe_grouped_mm(*args))
            except (RuntimeError, AttributeError) as exc:  # no _grouped_mm on this build
                print(f"grouped_mm unavailable: {exc}")
            case = f"{name} E={e} k={k} H={hdim} I={inter} batch={batch} bf16"
            row("fused_moe", case, t, base, target=("eager", 5.0))
            if "grouped_mm" in base:
                row("fused_moe", case, t, base, target=("grouped_mm", 1.5))


def bench_norm_rotary(quick: bool) -> None:
    t_, hidden = 16384, 8192
    x = torch.randn(t_, hidden, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(hidden, device=DEV, dtype=torch.bfloat16)
    t = cuda_ms(lambda: torch_topg.ops.rms_norm(x, w, 1e-6))
    eager = cuda_ms(
        lambda: (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, True) + 1e-6) * w).to(x.dtype)
    )
    row(
        "rms_norm",
        f"T={t_} H={hidden} bf16",
        t,
        {"eager": eager},
        bw_bytes=2 * x.nbytes,
        target=("bw", 0.8),
    )
    r = torch.randn_like(x)
    t = cuda_ms(lambda: torch_topg.ops.fused_add_rms_norm(x, r, w, 1e-6))
    row(
        "fused_add_rms_norm",
        f"T={t_} H={hidden} bf16",
        t,
        {},
        bw_bytes=4 * x.nbytes,
        target=("bw", 0.8),
    )
    hq, hk, d = 32, 8, 128
    q = torch.randn(t_, hq * d, device=DEV, dtype=torch.bfloat16)
    k = torch.randn(t_, hk * d, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (t_,), device=DEV)
    inv = 1.0 / 10000 ** (torch.arange(0, d, 2, device=DEV).float() / d)
    f = torch.outer(torch.arange(8192, device=DEV).float(), inv)
    cache = torch.cat([f.cos(), f.sin()], -1)
    call = lambda: torch_topg.ops.rotary_embedding(pos, q, k, d, cache, True)  # noqa: E731
    t, eager = graph_ms(call), cuda_ms(call)
    nbytes = 2 * (q.nbytes + k.nbytes)  # read and write q and k (cos/sin rows are small)
    row(
        "rotary_embedding",
        f"T={t_} Hq={hq} Hkv={hk} D={d} neox bf16",
        t,
        {"topg eager": eager},
        bw_bytes=nbytes,
        target=("bw", 0.8),
    )
    g = torch.randn(t_, 2 * 14336 // 4, device=DEV, dtype=torch.bfloat16)
    t = cuda_ms(lambda: torch_topg.ops.silu_and_mul(g))
    row("silu_and_mul", f"T={t_} I={14336 // 4} bf16", t, {}, bw_bytes=1.5 * g.nbytes)


def bench_linear(quick: bool) -> None:
    wt = torch.randn(14336, 4096, device=DEV, dtype=torch.bfloat16)
    for m in [1, 4] if quick else [1, 2, 4]:
        x = torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16)
        t = cuda_ms(lambda x=x: torch_topg.ops.linear(x, wt))
        base = {"F.linear": cuda_ms(lambda x=x: F.linear(x, wt))}
        row("linear", f"M={m} N=14336 K=4096 bf16", t, base, bw_bytes=wt.nbytes, note="no target")


def to_markdown() -> str:
    lines = [
        f"Copy bandwidth (device-to-device, read + write): {BW / 1e12:.2f} TB/s; "
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        "",
        "| op | case | topg ms | baselines ms | % BW | target | ratio | ok |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        base = ", ".join(f"{k} {v:.4f}" for k, v in r["baselines"].items())
        bw = f"{r['bw_pct']:.0f}" if "bw_pct" in r else ""
        ok = {True: "yes", False: "**no**", None: ""}[r.get("ok")]
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else ""
        lines.append(
            f"| {r['op']} | {r['case']} | {r['topg_ms']:.4f} | {base} | {bw} | "
            f"{r.get('target', r['note'])} | {ratio} | {ok} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    global BW
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--md", default="")
    p.add_argument("--json", default="")
    args = p.parse_args()
    assert torch.cuda.is_available(), "needs a CUDA device"
    assert _native.has_kernel("paged_attention", "CUDA"), _native.missing_reason("cuda")
    BW = copy_bandwidth()
    print(f"copy bandwidth {BW / 1e12:.2f} TB/s", flush=True)
    for fn in (bench_norm_rotary, bench_paged, bench_linear, bench_moe, bench_prefill):
        try:
            fn(args.quick)
        except Exception as exc:  # one family failing must not hide the others
            print(f"{fn.__name__} failed: {type(exc).__name__}: {exc}", flush=True)
            ROWS.append(
                {
                    "op": fn.__name__,
                    "case": f"FAILED: {exc}",
                    "topg_ms": float("nan"),
                    "baselines": {},
                    "note": "failed",
                }
            )
        torch.cuda.empty_cache()
    md = to_markdown()
    print(md)
    if args.md:
        open(args.md, "w").write(md)
    if args.json:
        json.dump({"copy_bw": BW, "rows": ROWS}, open(args.json, "w"), indent=1)


BW = 0.0
if __name__ == "__main__":
    main()
