"""``linear_q`` with int8 activations at M = 1, 4, 16 rows: the decode GEMV of a batch.

Times ``torch.ops.topg.linear_q(x[M, K], w[N, K] packed, fmt, int8_activations=True)``
(median of ``--repeats`` timings of ``--iters`` calls each) for Llama-3.2-1B-sized
weights ([8192, 2048]: gate / up, [2048, 8192]: down) in the formats of Q4_0, Q8_0 and
Q4_K_M files. The K-quant weights are seeded bytes with fixed half scales (the kernels'
time does not depend on the codes). Compare two builds by pointing ``TOPG_NATIVE_DIR``
at each library (docs/cpu-kernels.md has figures):

    OMP_NUM_THREADS=2 python python/benchmarks/linear_q_rows.py [--formats q4_0,q8_0,q4_k,q6_k]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_topg  # noqa: F401  (loads the native library: the topg ops)
from torch_topg.quant import FORMATS, quantize_weight


def packed(fmt: str, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """A packed [n, k] weight: quantised from Gaussian values, or seeded K-quant bytes."""
    f = FORMATS[fmt]
    if fmt not in ("q4_k", "q5_k", "q6_k"):
        return quantize_weight(torch.randn(n, k, generator=g) / k**0.5, fmt)
    raw = torch.randint(0, 256, (n * (k // f.block), f.block_bytes), generator=g).to(torch.uint8)
    half = lambda v: torch.tensor([v], dtype=torch.float16).view(torch.uint8)  # noqa: E731
    if fmt == "q6_k":
        raw[:, 208:210] = half(2.0**-10)
    else:
        raw[:, 0:2], raw[:, 2:4] = half(2.0**-7), half(2.0**-9)
    return raw.reshape(n, f.row_bytes(k))


def time_ms(fn, iters: int, repeats: int) -> float:
    """Median over repeats of the mean time of iters calls, in ms."""
    fn()
    runs = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t) / iters * 1e3)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", default="q4_0,q8_0,q4_k,q6_k")
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    print("| format | [N, K] | " + " | ".join(f"M={m} ms" for m in a.rows.split(",")) + " |")
    print("|---|---|" + "---|" * len(a.rows.split(",")))
    for fmt in a.formats.split(","):
        for n, k in ((8192, 2048), (2048, 8192)):
            w = packed(fmt, n, k, g)
            x = torch.randn(16, k, generator=g)
            cells = []
            for m in (int(v) for v in a.rows.split(",")):
                xm = x[:m].contiguous()
                ms = time_ms(
                    lambda xm=xm: torch.ops.topg.linear_q(xm, w, fmt, None, int8_activations=True),
                    a.iters,
                    a.repeats,
                )
                cells.append(f"{ms:.3f}")
            print(f"| {fmt} | [{n}, {k}] | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
