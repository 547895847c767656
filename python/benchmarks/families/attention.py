"""Attention family: prefill ``attention`` vs torch SDPA, decode ``paged_attention`` vs
the memory-bandwidth limit, ``reshape_and_cache`` vs ``index_copy_``.

SDPA gets the ``[B, H, S, D]`` layout it wants; both of its GQA forms are timed
(``enable_gqa=True`` and K/V ``repeat_interleave``d beforehand, the repeat not timed)
and the faster one is the baseline, named in the row. topg gets the same tensors as a
transposed ``[B, S, H, D]`` view (no copy), as Hugging Face would pass them. The
target is against the faster form in this run.

Decode ``paged_attention`` rows run cold: one large cache, and each call reads another
set of sequences (block tables over disjoint blocks), so that the sets together are at
least ``DRAM_FACTOR x`` the LLC. Prefill rows are compute-bound ("of best", "of peak").
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import torch_topg
from torch_topg import reference
from torch_topg.bench import cold_copies
from torch_topg.bench.rows import Rotation, Row, measure, single

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _prefill(s: int, d: int, dname: str, with_reference: bool, quick: bool) -> Row:
    b, hq, hkv = 1, 16, 4
    dtype = DTYPES[dname]
    q = torch.randn(b, hq, s, d, dtype=dtype)
    k = torch.randn(b, hkv, s, d, dtype=dtype)
    v = torch.randn(b, hkv, s, d, dtype=dtype)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    variants = {
        "topg": lambda: torch_topg.ops.attention(qt, kt, vt, causal=True),
        "sdpa(enable_gqa)": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        ),
        "sdpa(repeat_kv)": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True),
    }
    if with_reference:
        variants["reference"] = lambda: reference.attention(qt, kt, vt, causal=True)
    flops = 2 * 2 * b * hq * s * s / 2 * d  # QK^T and PV over the causal half
    case = f"B={b} S={s} Hq={hq} Hkv={hkv} D={d} causal"
    with torch.inference_mode():
        row = measure("attention", "attention", case, dname, variants, quick=quick,
                      heavy=True, flops=flops)  # fmt: skip
    sdpa = min(("sdpa(enable_gqa)", "sdpa(repeat_kv)"), key=lambda n: row.figures[n].median)
    row.target = (sdpa, 1.2)
    return row


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


def _prefill_memory(s: int = 8192, d: int = 64) -> Row | None:
    """One long causal prefill in a fresh process: time, and the growth of the peak
    resident set during the call (output included) against one S x S score matrix.
    None (and the process's last words printed) if that process fails."""
    hq, hkv = 16, 4
    probe = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(s), str(d)], capture_output=True, text=True
    )
    if probe.returncode != 0:
        print(f"[attention] S={s} memory row skipped: exit {probe.returncode}: "
              f"{probe.stderr.strip()[-400:]}", flush=True)  # fmt: skip
        return None
    grown, t_topg = (float(x) for x in probe.stdout.split())
    qs, ks, vs = (torch.randn(1, h, s, d) for h in (hq, hkv, hkv))
    with torch.inference_mode():
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        t_sdpa = (time.perf_counter() - t0) * 1e3
    scores = s * s * 4 / 2**20  # one head's fp32 score matrix, MiB
    out = s * hq * d * 4 / 2**20
    case = (f"B=1 S={s} Hq={hq} Hkv={hkv} D={d} causal; peak RSS +{grown:.0f} MiB "
            f"(output {out:.0f} MiB; one SxS fp32 score matrix {scores:.0f} MiB)")  # fmt: skip
    return single("attention", "attention", case, "fp32",
                  {"topg": t_topg, "sdpa(enable_gqa)": t_sdpa}, regime="compute",
                  note="one call each, topg in a fresh process")  # fmt: skip


def _paged(ns: int, ctx: int, dname: str, with_reference: bool, quick: bool) -> Row:
    hq, hkv, d, bs = 32, 8, 128, 16
    dtype = DTYPES[dname]
    nblk = ctx // bs
    elt = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * ns * ctx * hkv * d * elt
    sets = cold_copies(kv_bytes)
    kc = torch.randn(sets * ns * nblk, bs, hkv, d, dtype=dtype)
    vc = torch.randn(sets * ns * nblk, bs, hkv, d, dtype=dtype)
    perm = torch.randperm(sets * ns * nblk)  # scattered blocks, as after churn
    sl = torch.full((ns,), ctx, dtype=torch.int32)
    q = torch.randn(ns, hq, d, dtype=dtype)
    rot = Rotation(lambda i: (perm[i * ns * nblk : (i + 1) * ns * nblk].view(ns, nblk).int(),),
                   kv_bytes, cold=True)  # fmt: skip

    def gather_sdpa():  # stock PyTorch: gather the pages, then SDPA
        bt = rot.next()[0].long()
        k = kc[bt].view(ns, ctx, hkv, d).transpose(1, 2)
        v = vc[bt].view(ns, ctx, hkv, d).transpose(1, 2)
        return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)

    variants = {
        "topg": lambda: torch_topg.ops.paged_attention(q, kc, vc, rot.next()[0], sl),
        "gather+sdpa": gather_sdpa,
    }
    if with_reference:
        variants["reference"] = lambda: reference.paged_attention(q, kc, vc, rot.next()[0], sl)
    # From DRAM: K and V of every sequence, q and the block table (the output is written).
    nbytes = kv_bytes + q.numel() * elt + ns * nblk * 4
    case = f"seqs={ns} ctx={ctx} Hq={hq} Hkv={hkv} D={d} block={bs}"
    with torch.inference_mode():
        return measure("attention", "paged_attention", case, dname, variants, quick=quick,
                       heavy=with_reference and ns * ctx > 4096, dram_bytes=nbytes,
                       rotation=rot, target=("limit", 0.7))  # fmt: skip


def _paged_chunk(ns: int, q_len: int, ctx: int, dname: str, quick: bool) -> Row:
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

    variants = {
        "topg": lambda: torch_topg.ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=cu),
        "gather+sdpa": gather_sdpa,
        "gather+topg.attention": gather_attention,
    }
    flops = 2 * 2 * ns * hq * d * int(visible.sum())  # QK^T and PV over the visible keys
    case = f"seqs={ns} q_len={q_len} ctx={ctx} Hq={hq} Hkv={hkv} D={d} block={bs} (cu_seqlens_q)"
    with torch.inference_mode():
        return measure("attention", "paged_attention", case, dname, variants, quick=quick,
                       heavy=True, flops=flops)  # fmt: skip


def _cache(tokens: int, dname: str, quick: bool) -> Row:
    hkv, d, bs = 8, 128, 16
    dtype = DTYPES[dname]
    nblk = 4096
    kc = torch.zeros(nblk, bs, hkv, d, dtype=dtype)
    vc = torch.zeros(nblk, bs, hkv, d, dtype=dtype)
    key = torch.randn(tokens, hkv, d, dtype=dtype)
    value = torch.randn(tokens, hkv, d, dtype=dtype)
    slots = torch.randperm(nblk * bs)[:tokens]
    # From DRAM: K and V (written to random slots, whole rows). Run warm: "in cache". No
    # issue target (the issue asks only for memcpy-like rows).
    moved = 2 * key.numel() * key.element_size()
    with torch.inference_mode():
        return measure(
            "attention", "reshape_and_cache", f"T={tokens} Hkv={hkv} D={d} block={bs}", dname,
            {"topg": lambda: torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots),
             "index_copy_ (reference)": lambda: reference.reshape_and_cache(key, value, kc, vc, slots)},
            quick=quick, dram_bytes=moved, working_set=2 * moved,
        )  # fmt: skip


def run(quick: bool) -> list[Row]:
    rows: list[Row] = []
    prefill = [(512, 64), (1024, 128)] if quick else [(512, 64), (512, 128), (1024, 64),
                                                       (1024, 128), (2048, 64), (2048, 128)]  # fmt: skip
    paged = [(1, 512), (16, 4096)] if quick else [(1, 512), (1, 4096), (4, 1024), (4, 4096),
                                                   (16, 512), (16, 4096)]  # fmt: skip
    for dname in DTYPES:
        for s, d in prefill:
            rows.append(_prefill(s, d, dname, s <= 1024, quick))
        for ns, ctx in paged:
            rows.append(_paged(ns, ctx, dname, not quick or ns * ctx <= 4096, quick))
        rows.append(_paged_chunk(4, 128, 1024, dname, quick))
        for tokens in [16, 2048]:
            rows.append(_cache(tokens, dname, quick))
    if not quick and (row := _prefill_memory()) is not None:
        rows.append(row)
    return rows


if __name__ == "__main__":
    for row in run(quick="--full" not in sys.argv):
        print(row.key, {k: v.fmt() for k, v in row.ratios.items()}, row.regime, row.verdict)
