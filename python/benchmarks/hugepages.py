"""The decode step with its weights and KV cache on 4 KiB pages against transparent huge
pages (``torch_topg/utils/hugepages.py``), side by side in one process.

The engine (SmolLM2-135M-Instruct, decode plan, 2 threads) keeps its model on huge pages,
as it does on the CPU by default. A second decode plan is lowered over copies of the
model's tensors and KV cache on 4 KiB pages (``torch.empty``; torch's allocator uses huge
pages only under ``THP_MEM_ALLOC_ENABLE=1``), and the two plans' steps at batch 1 and 8
(context 256) are timed in interleaved rounds. Their logits must be bitwise equal. A
comparison across processes would not do: on a shared VM the speed moves more between
processes than the difference measured here (docs/decode-step.md).

    .venv/bin/python python/benchmarks/hugepages.py [--dtype fp32,bf16] [--quick]

Writes ``bench_results/hugepages-<date>-<commit>.json`` and prints the figures.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from decode_step import DTYPES, _engine, step_batch

from torch_topg.bench import Budget, compare, new_record, write_record
from torch_topg.bench.machine import machine_info
from torch_topg.compile.decode_plan import lower
from torch_topg.utils import hugepages

BATCHES = (1, 8)


def _small_pages(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def run_dtype(dtype: str, quick: bool) -> list[dict]:
    if not hugepages.enabled():
        raise SystemExit("hugepages.py: huge pages are off here (TOPG_HUGEPAGES=0 or no THP)")
    eng = _engine(dtype, True)
    try:
        r = eng.runner
        batches = {b: step_batch(r, b, b) for b in BATCHES}
        if r.plan is None:
            r.relower()
        small = copy.deepcopy(r.model)  # views into the fused buffers stay views
        with torch.no_grad():
            moved: dict[int, torch.Tensor] = {}
            for p in [*small.parameters(), *small.buffers()]:
                base = p.untyped_storage()
                key = base.data_ptr()
                if key not in moved:
                    moved[key] = _small_pages(torch.empty(0, dtype=torch.uint8).set_(base))
                view = torch.empty(0, dtype=p.dtype)
                view.set_(moved[key].untyped_storage(), p.storage_offset(), p.shape, p.stride())
                p.data = view
        kv_small = [_small_pages(t) for t in r.kv_caches]
        assert hugepages.is_advised(r.kv_caches[0]) and not hugepages.is_advised(kv_small[0])
        plans = {
            "huge pages": r.plan,
            "4 KiB pages": lower(small, kv_small, block_size=r.block_size,
                                 max_positions=r.max_blocks_per_seq * r.block_size),
        }  # fmt: skip
        rows = []
        for b, pb in batches.items():

            def step(plan, pb=pb):
                return plan.run(pb.input_ids, pb.positions, pb.slot_mapping, pb.block_tables,
                                pb.seq_lens, pb.cu_seqlens_q, pb.logits_indices)  # fmt: skip

            out = {k: step(p).clone() for k, p in plans.items()}
            if not torch.equal(out["huge pages"], out["4 KiB pages"]):
                raise AssertionError(f"{dtype} batch {b}: logits differ between the two plans")
            budget = Budget(warmup=2, min_rounds=5, max_rounds=6 if quick else 15, budget_s=8.0)
            c = compare({k: (lambda p=p: step(p)) for k, p in plans.items()}, budget)
            rows.append({
                "key": f"decode plan step | SmolLM2-135M | {dtype} | batch {b} | context 256",
                "unit": "ms",
                "figures": {k: c.ms(k).to_dict() for k in plans},
                "ratios": {"huge / 4 KiB time": c.ratio("huge pages", "4 KiB pages").to_dict()},
            })  # fmt: skip
        return rows
    finally:
        eng.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="fp32,bf16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="bench_results")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for dtype in a.dtype.split(","):
        if dtype not in DTYPES:
            raise SystemExit(f"--dtype: {dtype!r}, expected a subset of {sorted(DTYPES)}")
        rows += run_dtype(dtype, a.quick)
    for row in rows:
        f, r = row["figures"], row["ratios"]["huge / 4 KiB time"]
        print(f"{row['key']}: 4 KiB pages {f['4 KiB pages']['median']:.2f} ms, huge pages "
              f"{f['huge pages']['median']:.2f} ms, ratio {r['median']:.3f} "
              f"[{r['lo']:.3f}-{r['hi']:.3f}]")  # fmt: skip
    rec = new_record("hugepages", rows, machine_info(), quick=a.quick)
    print(f"record: {write_record(rec, a.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
