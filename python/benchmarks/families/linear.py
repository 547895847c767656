"""linear vs torch F.linear (same dtype and fp32), the reference and the physical limit.

M = 1 and 16 are memory-bound (limit: the weight bytes over the measured read
bandwidth); M = 256 is compute-bound (limit: FLOPs over torch's measured fp32 GEMM rate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Row, bench, bw_limit_ms, gemm_limit_ms, ms

import torch_topg
from torch_topg import reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _time(fn, heavy: bool) -> float:
    # A torch bf16 GEMM at M=256 takes seconds here: fewer runs for the heavy cases.
    return ms(bench(fn, warmup=1, min_runs=3, min_time_s=0.0) if heavy else bench(fn))


def _case(m: int, k: int, n: int, dname: str, dtype: torch.dtype, quick: bool) -> Row:
    heavy = m > 16
    x32, w32 = torch.randn(m, k), torch.randn(n, k) / k**0.5
    x, w = x32.to(dtype), w32.to(dtype)
    base: dict[str, float] = {}
    with torch.inference_mode():
        t_topg = _time(lambda: torch_topg.ops.linear(x, w), heavy)
        base["F.linear"] = _time(lambda: F.linear(x, w), heavy)
        if dtype != torch.float32 and heavy:
            base["F.linear fp32"] = _time(lambda: F.linear(x32, w32), heavy)
        if not (quick and heavy):
            base["reference"] = _time(lambda: reference.linear(x, w), heavy)
    if m <= 16:
        limit, kind = bw_limit_ms(w.numel() * w.element_size()), "read bw"
        target = ("limit", 0.8) if m == 1 else None
    else:
        limit, kind = gemm_limit_ms(2.0 * m * n * k), "gemm"
        target = ("F.linear fp32", 0.8) if dtype != torch.float32 else None
    return Row("linear", "linear", f"M={m} K={k} N={n}", dname, t_topg, base, limit, kind, target)


def run(quick: bool) -> list[Row]:
    shapes = [(1, 4096, 4096), (1, 1024, 32000), (256, 4096, 4096)]
    if not quick:
        shapes[2:2] = [(4, 4096, 4096), (16, 4096, 4096)]
    return [_case(*s, dname, dtype, quick) for s in shapes for dname, dtype in DTYPES.items()]


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        ratios = {name: f"{row.ratio(name):.2f}x" for name in row.baselines}
        print(f"{row.case:<24} {row.dtype} topg {row.topg_ms:8.3f} ms  {ratios}  "
              f"limit {row.ratio('limit'):.0%} {row.limit_kind}  ok={row.ok}")  # fmt: skip
