"""``linear_q`` with int8 activations at M = 1 to 512 rows: decode steps of a batch and prefill.

Times ``torch.ops.topg.linear_q(x[M, K], w[N, K] packed, fmt, int8_activations=True)``
(median of ``--repeats`` timings of about ``--seconds`` each) for Llama-3.2-1B-sized
weights ([8192, 2048]: gate / up, [2048, 8192]: down, [128256, 2048]: the LM head, which
Q4_K_M files store in q6_k) in the formats of Q4_0, Q8_0 and Q4_K_M files. The K-quant
weights are seeded bytes with fixed half scales (the kernels' time does not depend on
the codes). ``--gemv`` adds, for each M, the time of the GEMV (batch-invariant mode runs
the GEMV at every M): where the GEMM overtakes it gives the threshold
(quant::kQ8GemmRows). Compare two builds by pointing ``TOPG_NATIVE_DIR`` at each library
(docs/cpu-kernels.md has figures):

    OMP_NUM_THREADS=2 python python/benchmarks/linear_q_rows.py [--formats q4_0,q4_k,q6_k]
        [--rows 1,4,8,16,64,512] [--shapes 8192x2048,2048x8192,128256x2048] [--gemv]
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


def time_ms(fn, seconds: float, repeats: int) -> float:
    """Median over repeats of the mean time of a call, in ms; each repeat runs about
    `seconds` (at least one call)."""
    t = time.perf_counter()
    fn()
    iters = max(1, int(seconds / max(time.perf_counter() - t, 1e-6)))
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
    ap.add_argument("--rows", default="1,4,8,16,64,512")
    ap.add_argument("--shapes", default="8192x2048,2048x8192,128256x2048")
    ap.add_argument("--gemv", action="store_true", help="also time the GEMV at each M")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    rows = [int(v) for v in a.rows.split(",")]
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    head = " | ".join(f"M={m} ms" + (" (GEMV)" if a.gemv else "") for m in rows)
    print(f"| format | [N, K] | {head} |")
    print("|---|---|" + "---|" * len(rows))
    for fmt in a.formats.split(","):
        for n, k in shapes:
            w = packed(fmt, n, k, g)
            x = torch.randn(max(rows), k, generator=g)
            cells = []
            for m in rows:
                xm = x[:m].contiguous()

                def call(xm=xm):
                    return torch.ops.topg.linear_q(xm, w, fmt, None, int8_activations=True)

                cell = f"{time_ms(call, a.seconds, a.repeats):.3f}"
                if a.gemv:
                    previous = torch.ops.topg._set_batch_invariant(True)
                    try:
                        cell += f" ({time_ms(call, a.seconds, a.repeats):.3f})"
                    finally:
                        torch.ops.topg._set_batch_invariant(previous)
                cells.append(cell)
            print(f"| {fmt} | [{n}, {k}] | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
