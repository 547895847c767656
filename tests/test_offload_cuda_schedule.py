"""The CUDA path's stream/event schedule, checked without a GPU: ``CudaBackend`` runs
with a recording stand-in for ``torch.cuda`` (streams and events log what they are asked
to do; the copies themselves are host copies). The log is replayed to check that no
slot is overwritten before the compute stream is done with it, no layer runs before its
copy, and no pinned bounce buffer is refilled before the copy reading it completed."""

from __future__ import annotations

import contextlib
import itertools
import threading

import pytest
import torch
from offload_utils import bounded, logits, quiet_offload, tiny

from torch_topg.offload import FaultHooks
from torch_topg.offload.cuda import CudaBackend


class FakeCuda:
    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.compute = FakeStream(self, "compute")
        self.local = threading.local()

    def add(self, *entry: object) -> None:
        with self.lock:
            self.log.append(entry)

    def Stream(self, device=None):
        return FakeStream(self, "copy")

    def Event(self):
        return FakeEvent(self, next(self.ids))

    @contextlib.contextmanager
    def stream(self, s):  # type: ignore[no-untyped-def]
        prev = getattr(self.local, "current", self.compute)
        self.local.current = s
        try:
            yield
        finally:
            self.local.current = prev

    def current_stream(self, device=None):  # type: ignore[no-untyped-def]
        return getattr(self.local, "current", self.compute)


class FakeStream:
    def __init__(self, cuda: FakeCuda, name: str) -> None:
        self.cuda, self.name = cuda, name

    def wait_event(self, ev: FakeEvent) -> None:
        self.cuda.add("wait", self.name, ev.id)

    def synchronize(self) -> None:
        self.cuda.add("stream_sync", self.name)


class FakeEvent:
    def __init__(self, cuda: FakeCuda, id: int) -> None:
        self.cuda, self.id = cuda, id

    def record(self, stream: FakeStream) -> None:
        self.cuda.add("record", stream.name, self.id)

    def synchronize(self) -> None:
        self.cuda.add("event_sync", self.id)


class LoggingBackend(CudaBackend):
    def copy(self, job, throttle, stop):  # type: ignore[no-untyped-def]
        self.cuda.add("copy_begin", job.slot.index, job.layer)
        super().copy(job, throttle, stop)
        self.cuda.add("copy_end", job.slot.index, job.layer)

    def before_use(self, slot):  # type: ignore[no-untyped-def]
        super().before_use(slot)
        self.cuda.add("use", slot.index, slot.layer, slot.backend_state.copied.id)

    def after_use(self, slot):  # type: ignore[no-untyped-def]
        super().after_use(slot)
        self.cuda.add("release", slot.index, slot.layer, slot.backend_state.freed.id)


def check_schedule(log: list[tuple]) -> dict[str, int]:
    """Replay the log; assert the three ordering rules. Returns counts for the caller."""
    recorded_at: dict[int, int] = {}  # event id -> log position of its latest record
    last_use: dict[int, int] = {}  # slot -> log position of its latest use
    freed_event: dict[int, int] = {}  # slot -> id of its freed event
    copy_state: dict[int, dict] = {}  # slot -> the copy in progress / last done
    counts = {"copies": 0, "uses": 0, "slot_waits": 0, "bounce_syncs": 0}
    for pos, e in enumerate(log):
        kind = e[0]
        if kind == "record":
            recorded_at[e[2]] = pos
        elif kind == "copy_begin":
            copy_state[e[1]] = {"begin": pos, "waited": False, "layer": e[2]}
            counts["copies"] += 1
        elif kind == "wait" and e[1] == "copy":
            cur = [s for s, st in copy_state.items() if "end" not in st]
            assert len(cur) == 1, "a copy-stream wait outside a copy"
            slot = cur[0]
            assert freed_event.get(slot) == e[2], "copy waits on another slot's event"
            assert recorded_at[e[2]] > last_use[slot], "waits on a stale freed event"
            copy_state[slot]["waited"] = True
            counts["slot_waits"] += 1
        elif kind == "copy_end":
            st = copy_state[e[1]]
            st["end"] = pos
            if e[1] in last_use:  # the slot was used before: must have waited
                assert st["waited"], f"slot {e[1]} overwritten without waiting on its freed event"
        elif kind == "use":
            slot, layer, copied = e[1], e[2], e[3]
            st = copy_state[slot]
            assert st["layer"] == layer, "a layer bound to a slot holding another layer"
            assert "end" in st and recorded_at[copied] > st["begin"], "used before its copy"
            # the compute stream waited on this slot's copied event just before
            assert log[pos - 1] == ("wait", "compute", copied)
            last_use[slot] = pos
            counts["uses"] += 1
        elif kind == "release":
            freed_event[e[1]] = e[3]
            assert recorded_at[e[3]] > last_use[e[1]], "freed recorded before the use"
        elif kind == "event_sync":
            counts["bounce_syncs"] += 1
    return counts


@pytest.mark.parametrize("depth", [0, 1, 3])
@pytest.mark.parametrize("source", ["disk", "cpu"])
def test_cuda_schedule(depth: int, source: str) -> None:
    ref = tiny()
    expected = logits(ref)
    fake = FakeCuda()
    backend = LoggingBackend(torch.device("cpu"), pin_memory=True, cuda=fake, pin=False)
    model = tiny()
    delays = FaultHooks(before_copy=lambda i: None)
    h = quiet_offload(model, source=source, prefetch_depth=depth, _backend=backend, _hooks=delays)
    for _ in range(3):
        assert torch.equal(bounded(lambda: logits(model)), expected)
    h.close()
    counts = check_schedule(list(fake.log))
    assert counts["uses"] == 18
    assert counts["slot_waits"] > 0  # slots were reused, each time behind its event
    assert counts["bounce_syncs"] > 0  # unpinned sources go through the bounce buffers
    assert ("stream_sync", "copy") in fake.log  # close() drains the copy stream


def test_schedule_checker_catches_a_missing_wait() -> None:
    """The replay must fail on a schedule that overwrites a slot without waiting."""
    log = [
        ("copy_begin", 0, 0),
        ("record", "copy", 1),
        ("copy_end", 0, 0),
        ("wait", "compute", 1),
        ("use", 0, 0, 1),
        ("record", "compute", 2),
        ("release", 0, 0, 2),
        ("copy_begin", 0, 1),  # no ("wait", "copy", 2)
        ("record", "copy", 1),
        ("copy_end", 0, 1),
    ]
    with pytest.raises(AssertionError, match="overwritten without waiting"):
        check_schedule(log)
