"""Why some rows claimed more than the memory limit: the same topg call, warm (one input
set, used again and again: it stays in the LLC) and cold (input sets rotated, together
``DRAM_FACTOR x`` the LLC), side by side, each as a fraction of the DRAM limit.

    python python/benchmarks/warm_vs_cold.py [--quick] [--threads N]

The rows are those an earlier bench_ops run reported above 100% of the read bandwidth:
rotary T=512 (287%), fused add + RMSNorm T=512 (172%) and fused_moe at one token
(117%). Their working sets, 10, 16 and 17-35 MiB, fit in a 32 MiB LLC; run warm, the
"bytes from DRAM" never came from DRAM. The bytes counted are what must come from DRAM
(inputs; in-place outputs are written back, not read) and the probe runs in every
round. Cold, a fraction above 100% beyond the spread would mean a wrong byte count.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_topg
from torch_topg.bench import Budget, compare, describe, machine_info, read_probe, summarize
from torch_topg.bench.rows import Rotation, regime_of, size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def rotary(dtype: torch.dtype):
    t, hq, hk, d = 512, 32, 8, 128
    cache = torch.randn(4096, d, dtype=dtype)
    pos = torch.arange(100, 100 + t)

    def make(i: int):
        return torch.randn(t, hq * d, dtype=dtype), torch.randn(t, hk * d, dtype=dtype)

    def call(q, k):
        torch_topg.ops.rotary_embedding(pos, q, k, d, cache, True)

    ws = (t * (hq + hk) * d) * cache.element_size()  # q and k, read and written in place
    return "rotary_embedding llama8b T=512", make, call, ws, ws + t * d * cache.element_size()


def add_norm(dtype: torch.dtype):
    t, h = 512, 4096
    w = torch.ones(h, dtype=dtype)

    def make(i: int):
        return torch.randn(t, h, dtype=dtype), torch.randn(t, h, dtype=dtype)

    def call(x, r):
        torch_topg.ops.fused_add_rms_norm(x, r, w, 1e-6)

    n = t * h * w.element_size()  # x and r, read and written in place
    return "fused_add_rms_norm T=512 H=4096", make, call, 2 * n, 2 * n + h * w.element_size()


def moe(dtype: torch.dtype):
    from families.moe import INTER, H, mixtral_experts, routing

    x = torch.randn(1, H).to(dtype)
    weights, ids = routing(1)

    def make(i: int):
        e = mixtral_experts(dtype, seed=i)
        return e.gate_up_proj.detach(), e.down_proj.detach()

    def call(wgu, wd):
        torch_topg.ops.fused_moe(x, wgu, wd, weights, ids)

    hit = int(ids.unique().numel()) * 3 * H * INTER * x.element_size()
    return "fused_moe T=1 E=8 k=2", make, call, hit, hit + H * x.element_size()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(machine_info()))
    probe, probe_bytes = read_probe()
    budget = Budget.quick() if args.quick else Budget()
    print("| row | dtype | working set | warm: % of DRAM limit | cold: % of DRAM limit |")
    print("|---|---|---|---|---|")
    for build in (rotary, add_norm, moe):
        for dname, dtype in DTYPES.items():
            name, make, call, ws, nbytes = build(dtype)
            warm = Rotation(make, ws, cold=False)
            cold = Rotation(make, ws, cold=True)
            with torch.inference_mode():
                cmp = compare(
                    {
                        "warm": lambda w=warm: call(*w.next()),
                        "cold": lambda c=cold: call(*c.next()),
                        "probe": probe,  # the read bandwidth of each round
                    },
                    budget,
                )
            tp = cmp.samples["probe"]
            fw, fc = (
                summarize(
                    [nbytes * p / probe_bytes / t for p, t in zip(tp, cmp.samples[k], strict=True)]
                )
                for k in ("warm", "cold")
            )
            pct = lambda s: f"{s.median:.0%} [{s.lo:.0%}-{s.hi:.0%}]"  # noqa: E731
            print(
                f"| {name} | {dname} | {size(ws)}, {regime_of(ws)} | {pct(fw)} | "
                f"{pct(fc)} ({regime_of(ws, cold.n)}) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
