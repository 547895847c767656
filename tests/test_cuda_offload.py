"""torch_topg.offload on a CUDA device (skipped without one; run by python/gpu_suite.sh):
bitwise equality with the model resident on the GPU for depth 0-3 and both sources,
MoE experts, stats and residency bound, torch.compile, and the host-to-device copy rate
of the offload path next to a plain pinned memcpy (printed, not asserted: timing)."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
from conftest import NEEDS_CUDA
from offload_utils import TOKENS, tiny

import torch_topg
import torch_topg.compile  # registers backend="topg": the GPU suite runs uninstalled

pytestmark = NEEDS_CUDA
DEV = "cuda"


def _logits(model) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(TOKENS.to(DEV)).logits


def _offload(model, **kw):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="offload: the offloaded weights")  # tiny: fits
        return torch_topg.offload(model, device=DEV, **kw)


@pytest.mark.parametrize("depth", [0, 1, 2, 3])
@pytest.mark.parametrize("source", ["cpu", "disk"])
def test_cuda_offload_bitwise(depth: int, source: str) -> None:
    expected = _logits(tiny().to(DEV))
    model = tiny()
    h = _offload(model, source=source, prefetch_depth=depth)
    for _ in range(3):
        out = _logits(model)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)
    s = h.stats()
    assert s["bytes_moved"] > 0 and s["peak_resident_bytes"] <= s["bound_bytes"]
    if depth > 0:
        assert s["sync_fetches"] <= 1
    assert model.model.embed_tokens.weight.device.type == "cuda"  # resident parts moved
    h.close()


def test_cuda_offload_moe_and_resident_layers() -> None:
    expected = _logits(tiny("mixtral-tiny", layers=4).to(DEV))
    model = tiny("mixtral-tiny", layers=4)
    with _offload(model, source="disk", prefetch_depth=2, resident_layers=1) as h:
        for _ in range(2):
            assert torch.equal(_logits(model), expected)
        assert h.layers == [1, 2, 3]


def test_cuda_offload_unpinned_source() -> None:
    expected = _logits(tiny().to(DEV))
    model = tiny()
    with _offload(model, source="cpu", prefetch_depth=1, pin_memory=False):
        assert torch.equal(_logits(model), expected)


def test_cuda_offload_compile() -> None:
    expected = _logits(tiny(layers=3).to(DEV))
    model = tiny(layers=3)
    with _offload(model, source="disk", prefetch_depth=1):
        compiled = torch.compile(model, backend="topg")
        for _ in range(2):
            torch.testing.assert_close(_logits(compiled), expected, atol=1e-4, rtol=1e-4)


def test_cuda_offload_h2d_rate_printed() -> None:
    """Reader-only transfer of 8 x 32 MiB layers vs the same bytes with one pinned
    memcpy per layer on a side stream. Printed for the log; the benchmark
    (python/benchmarks/gpu/offload_h2d.py) holds the target."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Linear(2048, 4096, bias=False) for _ in range(8)])
    model = torch.nn.Sequential(blocks)
    with _offload(model, source="cpu", layers="0", prefetch_depth=2) as h:
        nbytes = h.stats()["largest_layer_bytes"] * 8

        def offloaded() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(8):
                h.wait(i)
                h.release(i)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        offloaded()
        t_off = min(offloaded() for _ in range(3))
    host = torch.empty(nbytes // 8, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=DEV)
    side = torch.cuda.Stream()

    def memcpy() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            for _ in range(8):
                dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    memcpy()
    t_cp = min(memcpy() for _ in range(3))
    print(
        f"\noffload H2D: {nbytes / t_off / 1e9:.1f} GB/s, pinned memcpy "
        f"{nbytes / t_cp / 1e9:.1f} GB/s, ratio {t_cp / t_off:.2f} (target >= 0.80)"
    )
