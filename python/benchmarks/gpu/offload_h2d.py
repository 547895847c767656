"""GPU offload benchmark (run by gpu_suite.sh): host-to-device copy rate of the offload
path vs a plain pinned memcpy, and an offloaded forward vs max(compute, transfer).

    python3 python/benchmarks/gpu/offload_h2d.py [--quick] [--md offload.md]

Rows (with the targets set when offload was built):
  H2D, source="cpu" (pinned once) and source="disk" (mmap -> pinned bounce -> device):
      offload reader bytes/s over pinned memcpy bytes/s            >= 0.80
  mixtral-360m bf16 prefill (128 tokens), weights offloaded to host, depth 0..3:
      forward / max(compute-only, transfer-only)                    <= 1.10
Timing: ``torch_topg.bench.wall_clock`` (the host's clock after torch.cuda.synchronize()),
best of a few runs (the copies run on
their own stream from a host thread, so CUDA events on one stream would miss them).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch

import torch_topg
from torch_topg.bench import bench, wall_clock
from torch_topg.models import build_model

DEV = "cuda"


def best_s(fn: Callable[[], object], reps: int = 3) -> float:
    clock = wall_clock(DEV)
    return bench(fn, warmup=1, min_runs=reps, max_runs=reps, min_time_s=0.0, clock=clock).min_s


def quiet(model, **kw):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch_topg.offload(model, device=DEV, **kw)


def h2d_rows(quick: bool) -> list[str]:
    n, mib = (8, 32) if quick else (16, 64)
    cols = mib * 2**20 // (4 * 4096)
    rows = []
    host = torch.empty(mib * 2**20, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=DEV)
    side = torch.cuda.Stream()

    def memcpy() -> None:
        with torch.cuda.stream(side):
            for _ in range(n):
                dev.copy_(host, non_blocking=True)

    t_cp = best_s(memcpy)
    total = n * mib * 2**20
    for source in ("cpu", "disk"):
        blocks = torch.nn.Sequential(*[torch.nn.Linear(cols, 4096, bias=False) for _ in range(n)])
        model = torch.nn.Sequential(blocks)
        with quiet(model, source=source, layers="0", prefetch_depth=2) as h:

            def stream_all(h=h) -> None:
                for i in range(n):
                    h.wait(i)
                    h.release(i)

            t_off = best_s(stream_all)
        ratio = t_cp / t_off
        rows.append(
            f"| H2D source={source} | {n} x {mib} MiB | {total / t_off / 1e9:.1f} GB/s | "
            f"memcpy {total / t_cp / 1e9:.1f} GB/s | {ratio:.2f} | >= 0.80 | "
            f"{'ok' if ratio >= 0.8 else 'MISSED'} |"
        )
    return rows


def forward_rows(quick: bool) -> list[str]:
    rows = []
    tokens = torch.randint(0, 32000, (1, 128), device=DEV)
    resident = build_model("mixtral-360m", torch.bfloat16).to(DEV)

    def fwd(m) -> None:  # type: ignore[no-untyped-def]
        with torch.no_grad():
            m(tokens)

    t_compute = best_s(lambda m=resident: fwd(m))
    del resident
    for depth in (0, 1, 2, 3) if not quick else (0, 1, 2):
        model = build_model("mixtral-360m", torch.bfloat16)
        with quiet(model, source="cpu", prefetch_depth=depth) as h:
            layers = h.layers

            def transfer(h=h, layers=layers) -> None:
                for i in layers:
                    h.wait(i)
                    h.release(i)

            t_transfer = best_s(transfer)
            t_fwd = best_s(lambda m=model: fwd(m))
            peak, bound = h.stats()["peak_resident_bytes"], h.stats()["bound_bytes"]
        ratio = t_fwd / max(t_compute, t_transfer)
        rows.append(
            f"| mixtral-360m bf16 S=128 depth={depth} | fwd {t_fwd * 1e3:.1f} ms | compute "
            f"{t_compute * 1e3:.1f} ms | transfer {t_transfer * 1e3:.1f} ms | {ratio:.2f} | "
            f"<= 1.10 | {'ok' if ratio <= 1.1 else 'MISSED'} (peak {peak / 2**20:.0f} / "
            f"bound {bound / 2**20:.0f} MiB) |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--md", default=None)
    args = ap.parse_args()
    lines = [
        "| case | size | offload | baseline | ratio | target | |",
        "|---|---|---|---|---|---|---|",
        *h2d_rows(args.quick),
        *forward_rows(args.quick),
    ]
    text = "\n".join(lines)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
