"""linear vs torch F.linear (same dtype and fp32), the reference and the physical limit.

M = 1, 4 and 16 are memory-bound: the limit is the weight (and x, out) bytes over the
measured read bandwidth, and the rows run cold: weights under ``DRAM_FACTOR x`` the LLC
are rotated through copies (as a model's layers follow one another), every variant on
the same rotation. M = 256 is compute-bound: "of best" (the best rate any variant
reached on the shape) and "of peak" (the theoretical fp32 peak).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import torch_topg
from torch_topg import reference
from torch_topg.bench.rows import Rotation, Row, measure

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _case(m: int, k: int, n: int, dname: str, dtype: torch.dtype, quick: bool) -> Row:
    # A torch bf16 GEMM at M=256 takes seconds here: fewer rounds for the heavy cases.
    heavy = m > 16
    x32 = torch.randn(m, k)
    x = x32.to(dtype)
    elt = x.element_size()

    def weights(i: int):
        w32 = torch.randn(n, k, generator=torch.Generator().manual_seed(i)) / k**0.5
        return (w32, w32.to(dtype)) if heavy and dtype != torch.float32 else (w32.to(dtype),)

    nbytes = (n * k + m * k) * elt  # from DRAM: w and x (the output is written)
    rot = Rotation(weights, n * k * elt, cold=not heavy)
    variants = {
        "topg": lambda: torch_topg.ops.linear(x, rot.next()[-1]),
        "F.linear": lambda: F.linear(x, rot.next()[-1]),
    }
    if dtype != torch.float32 and heavy:
        variants["F.linear fp32"] = lambda: F.linear(x32, rot.next()[0])
    if not (quick and heavy):
        variants["reference"] = lambda: reference.linear(x, rot.next()[-1])
    if m <= 16:
        target = ("limit", 0.8) if m == 1 else None
        kw = {"dram_bytes": nbytes, "rotation": rot}
    else:
        target = ("F.linear fp32", 0.8) if dtype != torch.float32 else None
        kw = {"flops": 2.0 * m * n * k}
    with torch.inference_mode():
        return measure("linear", "linear", f"M={m} K={k} N={n}", dname, variants,
                       quick=quick, heavy=heavy, target=target, **kw)  # fmt: skip


def run(quick: bool) -> list[Row]:
    shapes = [(1, 4096, 4096), (1, 1024, 32000), (256, 4096, 4096)]
    if not quick:
        shapes[2:2] = [(4, 4096, 4096), (16, 4096, 4096)]
    return [_case(*s, dname, dtype, quick) for s in shapes for dname, dtype in DTYPES.items()]


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        print(row.key, {k: v.fmt() for k, v in row.ratios.items()}, row.regime, row.verdict)
