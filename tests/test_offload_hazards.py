"""Offload hazards: delayed copies and delayed compute, an I/O error at layer k raised at
its use, close() with copies in flight or while compute waits, double close, the handle
garbage-collected mid-copy. Every wait is bounded (a hang fails the test, never the run)."""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
from offload_utils import bounded, logits, quiet_offload, tiny

from torch_topg.offload import FaultHooks


@pytest.mark.parametrize("depth", [1, 3])
def test_delayed_copies(depth: int) -> None:
    """A reader slower than compute: results exact, the compute thread stalls."""
    ref = tiny()
    expected = logits(ref)
    model = tiny()
    hooks = FaultHooks(before_copy=lambda i: time.sleep(0.01 * (i % 3)))
    h = quiet_offload(model, source="disk", prefetch_depth=depth, _hooks=hooks)
    for _ in range(2):
        assert torch.equal(bounded(lambda: logits(model)), expected)
    s = h.stats()
    assert s["stall_s"] > 0 and 0.0 <= s["overlap"] <= 1.0
    h.close()


@pytest.mark.parametrize("depth", [0, 2])
def test_delayed_compute(depth: int) -> None:
    """Compute slower than the reader: prefetched slots wait, nothing is overwritten."""
    ref = tiny()
    expected = logits(ref)
    model = tiny()
    seen: list[int] = []

    def slow(i: int) -> None:
        seen.append(i)
        time.sleep(0.01)

    h = quiet_offload(
        model, source="disk", prefetch_depth=depth, _hooks=FaultHooks(after_bind=slow)
    )
    for _ in range(2):
        assert torch.equal(bounded(lambda: logits(model)), expected)
    assert seen == list(range(6)) * 2
    assert h.stats()["peak_resident_bytes"] <= h.stats()["bound_bytes"]
    h.close()


def test_throttled_reader_bitwise() -> None:
    ref = tiny(layers=3)
    expected = logits(ref)
    model = tiny(layers=3)
    with quiet_offload(model, source="disk", prefetch_depth=1, read_bandwidth=20e6) as h:
        assert torch.equal(bounded(lambda: logits(model)), expected)
        s = h.stats()
        # every layer (plus the prefetched next first layer) read at <= 20 MB/s
        assert s["read_s"] >= s["bytes_moved"] / 20e6 * 0.99


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_io_error_raised_at_use(depth: int) -> None:
    ref = tiny()
    expected = logits(ref)
    model = tiny()
    fail = {"left": 1}  # a transient error: the first read of layer 3 only

    def before_copy(i: int) -> None:
        if i == 3 and fail["left"]:
            fail["left"] -= 1
            raise OSError("injected read error")

    h = quiet_offload(
        model, source="disk", prefetch_depth=depth, _hooks=FaultHooks(before_copy=before_copy)
    )
    with pytest.raises(
        RuntimeError, match=r"layer 3 \(model\.layers\.3\) failed: OSError: injected"
    ):
        bounded(lambda: logits(model))
    for i in range(6):  # the failed forward left no layer bound
        assert torch.isnan(model.model.layers[i].mlp.up_proj.weight).all()
    assert fail["left"] == 0  # raised at the use although a re-read would have worked
    assert torch.equal(bounded(lambda: logits(model)), expected)  # recovers: re-read
    h.close()


def test_close_with_copies_in_flight_and_double_close() -> None:
    ref = tiny()
    expected = logits(ref)
    model = tiny()
    # ~0.4 MB per layer at 1 MB/s: the first prefetches are still running at close()
    h = quiet_offload(model, source="disk", prefetch_depth=3, read_bandwidth=1e6)
    thread = h._engine.reader.thread
    time.sleep(0.05)
    bounded(h.close, timeout=10)
    assert not thread.is_alive() and h.closed
    bounded(h.close, timeout=10)  # idempotent
    assert torch.equal(logits(model), expected)  # restored: weights from the map
    with pytest.raises(RuntimeError, match="closed handle"):
        h.wait(0)


def test_close_while_compute_waits() -> None:
    """close() from another thread while the forward waits for a slow copy: the
    forward raises instead of hanging."""
    model = tiny()
    h = quiet_offload(model, source="disk", prefetch_depth=1, read_bandwidth=2e5)

    def close_once_forward_started() -> None:
        deadline = time.monotonic() + 10
        while h._engine.order._recording is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # layer 0 takes ~2 s to read at 200 kB/s: compute is waiting
        h.close()

    closer = threading.Thread(target=close_once_forward_started, daemon=True)
    closer.start()
    with pytest.raises(RuntimeError, match="closed"):
        bounded(lambda: logits(model), timeout=20)
    closer.join(10)
    assert h.closed


def test_handle_garbage_collected_mid_copy() -> None:
    model = tiny()
    h = quiet_offload(model, source="disk", prefetch_depth=2, read_bandwidth=1e6)
    thread = h._engine.reader.thread
    time.sleep(0.05)
    del h, model  # the model keeps its handle: both go at once
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_handle_dropped_but_model_kept() -> None:
    """The model holds its handle: dropping the user's reference does not stop it."""
    ref = tiny()
    expected = logits(ref)
    model = tiny()
    h = quiet_offload(model, source="disk", prefetch_depth=1)
    thread = h._engine.reader.thread
    del h
    gc.collect()
    assert thread.is_alive()
    assert torch.equal(bounded(lambda: logits(model)), expected)
    model._topg_offload.close()
    assert not thread.is_alive()


@pytest.mark.parametrize("where", ["hook", "layer"])
def test_error_in_compute_releases_layer(where: str) -> None:
    """An exception after a layer is bound (in the fault hook, or inside the layer's own
    forward) still releases its slot and leaves placeholders."""
    model = tiny()
    boom = {"on": True}

    def after_bind(i: int) -> None:
        if i == 2 and boom["on"] and where == "hook":
            raise ValueError("compute failed")

    mlp = model.model.layers[2].mlp
    orig = mlp.forward

    def failing(*args, **kwargs):  # type: ignore[no-untyped-def]
        if boom["on"] and where == "layer":
            raise ValueError("compute failed")
        return orig(*args, **kwargs)

    mlp.forward = failing
    h = quiet_offload(
        model, source="disk", prefetch_depth=1, _hooks=FaultHooks(after_bind=after_bind)
    )
    with pytest.raises(ValueError, match="compute failed"):
        bounded(lambda: logits(model))
    assert torch.isnan(model.model.layers[2].mlp.up_proj.weight).all()
    boom["on"] = False
    expected = logits(tiny())
    assert torch.equal(bounded(lambda: logits(model)), expected)
    assert all(s.users == 0 for s in h._engine.pool.slots)
    h.close()
