"""Attention family: prefill ``attention`` vs torch SDPA, decode ``paged_attention`` vs
the memory-bandwidth limit, ``reshape_and_cache`` vs ``index_copy_``.

SDPA gets the ``[B, H, S, D]`` layout it wants; both of its GQA forms are timed
(``enable_gqa=True`` and K/V ``repeat_interleave``d beforehand, the repeat not timed)
and the faster one is the baseline, named in the row. topg gets the same tensors as a
transposed ``[B, S, H, D]`` view (no copy), as Hugging Face would pass them.
"""

from __future__ import annotations

import subprocess
import sys

import torch
import torch.nn.functional as F
from common import Row, bench, bw_limit_ms, gemm_limit_ms, ms

import torch_topg
from torch_topg import reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _heavy(fn) -> float:
    """Median of a few runs of something that takes up to seconds."""
    return ms(bench(fn, warmup=1, min_runs=3, min_time_s=0.0))


def _prefill(s: int, d: int, dname: str, with_reference: bool) -> Row:
    b, hq, hkv = 1, 16, 4
    dtype = DTYPES[dname]
    q = torch.randn(b, hq, s, d, dtype=dtype)
    k = torch.randn(b, hkv, s, d, dtype=dtype)
    v = torch.randn(b, hkv, s, d, dtype=dtype)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    base: dict[str, float] = {}
    with torch.inference_mode():
        t_topg = _heavy(lambda: torch_topg.ops.attention(qt, kt, vt, causal=True))
        gqa = _heavy(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        )
        rep = _heavy(lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
        sdpa = "sdpa(enable_gqa)" if gqa <= rep else "sdpa(repeat_kv)"
        base[sdpa] = min(gqa, rep)
        if with_reference:
            base["reference"] = _heavy(lambda: reference.attention(qt, kt, vt, causal=True))
    flops = 2 * 2 * b * hq * s * s / 2 * d  # QK^T and PV over the causal half
    case = f"B={b} S={s} Hq={hq} Hkv={hkv} D={d} causal"
    return Row("attention", "attention", case, dname, t_topg, base, gemm_limit_ms(flops), "gemm",
               (sdpa, 1.2))  # fmt: skip


_MEMORY_PROBE = """
import sys, time, torch, torch_topg
def hwm_kib():  # peak resident set (VmHWM), reset below through /proc/self/clear_refs
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
s, d, hq, hkv = int(sys.argv[1]), int(sys.argv[2]), 16, 4
q, k, v = torch.randn(1, s, hq, d), torch.randn(1, s, hkv, d), torch.randn(1, s, hkv, d)
torch_topg.ops.attention(q[:, :256], k[:, :256], v[:, :256], causal=True)  # warm up
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # peak := current resident set
before = hwm_kib()
t0 = time.perf_counter()
torch_topg.ops.attention(q, k, v, causal=True)
t1 = time.perf_counter()
print((hwm_kib() - before) / 1024, (t1 - t0) * 1e3)
"""


def _prefill_memory(s: int = 8192, d: int = 64) -> Row:
    """One long causal prefill in a fresh process: time, and the growth of the peak
    resident set during the call (output included) against one S x S score matrix."""
    hq, hkv = 16, 4
    probe = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(s), str(d)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    grown, t_topg = (float(x) for x in probe.stdout.split())
    qs, ks, vs = (torch.randn(1, h, s, d) for h in (hq, hkv, hkv))
    with torch.inference_mode():
        t_sdpa = ms(bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                 enable_gqa=True),
                          warmup=0, min_runs=1, min_time_s=0.0))  # fmt: skip
    scores = s * s * 4 / 2**20  # one head's fp32 score matrix, MiB
    out = s * hq * d * 4 / 2**20
    case = (f"B=1 S={s} Hq={hq} Hkv={hkv} D={d} causal; peak RSS +{grown:.0f} MiB "
            f"(output {out:.0f} MiB; one SxS fp32 score matrix {scores:.0f} MiB)")  # fmt: skip
    flops = 2 * 2 * hq * s * s / 2 * d
    return Row("attention", "attention", case, "fp32", t_topg, {"sdpa(enable_gqa)": t_sdpa},
               gemm_limit_ms(flops), "gemm")  # fmt: skip


def _paged(ns: int, ctx: int, dname: str, with_reference: bool) -> Row:
    hq, hkv, d, bs = 32, 8, 128, 16
    dtype = DTYPES[dname]
    nblk = ctx // bs
    kc = torch.randn(ns * nblk, bs, hkv, d, dtype=dtype)
    vc = torch.randn(ns * nblk, bs, hkv, d, dtype=dtype)
    bt = torch.randperm(ns * nblk).view(ns, nblk).int()  # scattered blocks, as after churn
    sl = torch.full((ns,), ctx, dtype=torch.int32)
    q = torch.randn(ns, hq, d, dtype=dtype)

    def gather_sdpa():  # stock PyTorch: gather the pages, then SDPA
        k = kc[bt.long()].view(ns, ctx, hkv, d).transpose(1, 2)
        v = vc[bt.long()].view(ns, ctx, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

    base: dict[str, float] = {}
    with torch.inference_mode():
        t_topg = ms(bench(lambda: torch_topg.ops.paged_attention(q, kc, vc, bt, sl)))
        base["gather+sdpa"] = ms(bench(gather_sdpa, min_runs=3, min_time_s=0.1))
        if with_reference:
            base["reference"] = _heavy(lambda: reference.paged_attention(q, kc, vc, bt, sl))
    kv_bytes = 2 * ns * ctx * hkv * d * kc.element_size()
    case = f"seqs={ns} ctx={ctx} Hq={hq} Hkv={hkv} D={d} block={bs}"
    return Row("attention", "paged_attention", case, dname, t_topg, base, bw_limit_ms(kv_bytes),
               "read bw", ("limit", 0.7))  # fmt: skip


def _paged_chunk(ns: int, q_len: int, ctx: int, dname: str) -> Row:
    """Ragged paged_attention (cu_seqlens_q): a q_len-token prefill chunk per sequence, the
    last tokens of a ctx-token context already in the cache, read in place."""
    hq, hkv, d, bs = 32, 8, 128, 16
    dtype = DTYPES[dname]
    nblk = ctx // bs
    kc = torch.randn(ns * nblk, bs, hkv, d, dtype=dtype)
    vc = torch.randn(ns * nblk, bs, hkv, d, dtype=dtype)
    bt = torch.randperm(ns * nblk).view(ns, nblk).int()
    sl = torch.full((ns,), ctx, dtype=torch.int32)
    cu = torch.arange(ns + 1, dtype=torch.int32) * q_len
    q = torch.randn(ns * q_len, hq, d, dtype=dtype)
    cu_k = torch.arange(ns + 1, dtype=torch.int32) * ctx
    # Bottom-right causal: chunk row i sees keys 0 .. ctx - q_len + i.
    visible = torch.arange(ctx)[None, :] <= torch.arange(q_len)[:, None] + (ctx - q_len)

    def gather_attention():  # gather the pages, then topg's ragged prefill attention
        k = kc[bt.long()].view(ns * ctx, hkv, d)
        v = vc[bt.long()].view(ns * ctx, hkv, d)
        return torch_topg.ops.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu_k, causal=True)

    def gather_sdpa():  # stock PyTorch: gather the pages, then SDPA with the causal mask
        k = kc[bt.long()].view(ns, ctx, hkv, d).transpose(1, 2)
        v = vc[bt.long()].view(ns, ctx, hkv, d).transpose(1, 2)
        qs = q.view(ns, q_len, hq, d).transpose(1, 2)
        return F.scaled_dot_product_attention(qs, k, v, attn_mask=visible, enable_gqa=True)

    base: dict[str, float] = {}
    with torch.inference_mode():
        call = lambda: torch_topg.ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=cu)  # noqa: E731
        t_topg = _heavy(call)
        base["gather+sdpa"] = _heavy(gather_sdpa)
        base["gather+topg.attention"] = _heavy(gather_attention)
    flops = 2 * 2 * ns * hq * d * int(visible.sum())  # QK^T and PV over the visible keys
    case = f"seqs={ns} q_len={q_len} ctx={ctx} Hq={hq} Hkv={hkv} D={d} block={bs} (cu_seqlens_q)"
    return Row("attention", "paged_attention", case, dname, t_topg, base, gemm_limit_ms(flops),
               "gemm")  # fmt: skip


def _cache(tokens: int, dname: str) -> Row:
    hkv, d, bs = 8, 128, 16
    dtype = DTYPES[dname]
    nblk = 4096
    kc = torch.zeros(nblk, bs, hkv, d, dtype=dtype)
    vc = torch.zeros(nblk, bs, hkv, d, dtype=dtype)
    key = torch.randn(tokens, hkv, d, dtype=dtype)
    value = torch.randn(tokens, hkv, d, dtype=dtype)
    slots = torch.randperm(nblk * bs)[:tokens]
    with torch.inference_mode():
        t_topg = ms(bench(lambda: torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots)))
        t_ref = ms(bench(lambda: reference.reshape_and_cache(key, value, kc, vc, slots)))
    # Read K/V, write them to random slots (whole rows): limit = that traffic at the read
    # bandwidth. No issue target (the issue asks only for memcpy-like rows).
    moved = 2 * 2 * key.numel() * key.element_size()
    return Row("attention", "reshape_and_cache", f"T={tokens} Hkv={hkv} D={d} block={bs}", dname,
               t_topg, {"index_copy_ (reference)": t_ref}, bw_limit_ms(moved), "read bw")  # fmt: skip


def run(quick: bool) -> list[Row]:
    rows: list[Row] = []
    prefill = [(512, 64), (1024, 128)] if quick else [(512, 64), (512, 128), (1024, 64),
                                                       (1024, 128), (2048, 64), (2048, 128)]  # fmt: skip
    paged = [(1, 512), (16, 4096)] if quick else [(1, 512), (1, 4096), (4, 1024), (4, 4096),
                                                   (16, 512), (16, 4096)]  # fmt: skip
    for dname in DTYPES:
        for s, d in prefill:
            rows.append(_prefill(s, d, dname, with_reference=s <= 1024))
        for ns, ctx in paged:
            rows.append(_paged(ns, ctx, dname, with_reference=not quick or ns * ctx <= 4096))
        rows.append(_paged_chunk(4, 128, 1024, dname))
        for tokens in [16, 2048]:
            rows.append(_cache(tokens, dname))
    if not quick:
        rows.append(_prefill_memory())
    return rows


if __name__ == "__main__":
    for row in run(quick="--full" not in sys.argv):
        ratios = {n: f"{row.ratio(n):.2f}x" for n in row.baselines}
        if row.limit_ms:
            ratios["limit"] = f"{row.ratio('limit'):.2f}"
        print(
            f"{row.op:18s} {row.dtype} {row.case:50s} {row.topg_ms:9.3f} ms  {ratios}  ok={row.ok}"
        )
