"""The CUDA path: one copy stream, per-slot events, a ring of ``depth + 1`` device slots.

Ordering, all on the GPU (the host never waits for a copy to finish):
* before the reader overwrites slot s, the copy stream waits on ``freed[s]``, an event
  recorded on the compute stream right after the layer that last used s finished;
* after the copies of a layer, ``copied[s]`` is recorded on the copy stream; before the
  layer runs, the compute stream waits on it.
Host sources: for source="cpu" the tensors are pinned once (``pin_memory``) and copied
with ``non_blocking=True`` straight from there; memory-mapped (disk) sources go through
two pinned bounce buffers that alternate, each reused only after the copy that last
read it has completed (``bounce_free`` events, waited on by the reader thread).

The stream and event operations go through ``self.cuda`` (``torch.cuda`` by default),
so the schedule can be tested without a GPU with a recording stand-in.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import torch

from torch_topg.offload.pool import Slot
from torch_topg.offload.reader import CHUNK, Cancelled, Job, Throttle, chunks, host_copy

BOUNCE = 2 * CHUNK


@dataclasses.dataclass
class SlotEvents:
    copied: Any  # recorded on the copy stream after the slot's copy
    freed: Any = None  # recorded on the compute stream after the slot's last use


class CudaBackend:
    name = "cuda"
    align = 512  # the CUDA caching allocator's alignment

    def __init__(
        self,
        device: torch.device,
        pin_memory: bool = True,
        cuda: Any = None,
        pin: bool | None = None,
    ) -> None:
        self.cuda = cuda if cuda is not None else torch.cuda
        self.device = device
        self.pin_memory = pin_memory
        # `pin` is False only under the GPU-less test (pinning needs a CUDA context)
        self._pin = pin_memory if pin is None else pin and pin_memory
        self.copy_stream = self.cuda.Stream(device=device)
        self._bounce: list[torch.Tensor] = []
        self._bounce_free: list[Any] = []
        self._alloc_device = device if cuda is None else torch.device("cpu")

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self._alloc_device)

    def prepare_source(self, t: torch.Tensor) -> torch.Tensor:
        """Pin a host tensor once (source="cpu"), so its copies are true async DMA."""
        if self._pin and not t.is_pinned():
            return t.pin_memory()
        return t

    def _bounces(self) -> tuple[list[torch.Tensor], list[Any]]:
        if not self._bounce:
            for _ in range(2):
                self._bounce.append(torch.empty(BOUNCE, dtype=torch.uint8, pin_memory=self._pin))
                self._bounce_free.append(None)
        return self._bounce, self._bounce_free

    def copy(self, job: Job, throttle: Throttle, stop: threading.Event) -> None:
        """Runs on the reader thread: enqueue the layer's copies on the copy stream."""
        slot = job.slot
        ev = slot.backend_state
        if ev is None:
            ev = slot.backend_state = SlotEvents(copied=self.cuda.Event())
        t0 = time.perf_counter()
        moved = 0
        with self.cuda.stream(self.copy_stream):
            if ev.freed is not None:  # never overwrite a slot the compute stream still reads
                self.copy_stream.wait_event(ev.freed)
            bounce, free = None, None
            k = 0
            for off, src in chunks(job.layout, job.sources):
                if stop.is_set():
                    raise Cancelled
                n = src.numel()
                dst = slot.buf[off : off + n]
                if src.is_pinned():  # source="cpu", pinned once: straight DMA
                    dst.copy_(src, non_blocking=True)
                else:
                    if bounce is None:
                        bounce, free = self._bounces()
                    if free[k] is not None:
                        free[k].synchronize()  # the copy that last read this buffer is done
                    host_copy(bounce[k], src, n)  # the storage read happens here
                    dst.copy_(bounce[k][:n], non_blocking=True)
                    if free[k] is None:
                        free[k] = self.cuda.Event()
                    free[k].record(self.copy_stream)
                    k ^= 1
                moved += n
                throttle.pace(t0, moved, stop)
            ev.copied.record(self.copy_stream)

    def before_use(self, slot: Slot) -> None:
        """Compute thread: the layer's kernels start after its copies (a GPU-side wait)."""
        self.cuda.current_stream(self.device).wait_event(slot.backend_state.copied)

    def after_use(self, slot: Slot) -> None:
        """Compute thread: mark where the compute stream stops reading the slot."""
        ev = slot.backend_state
        if ev.freed is None:
            ev.freed = self.cuda.Event()
        ev.freed.record(self.cuda.current_stream(self.device))

    def close(self) -> None:
        # the reader is joined: let queued copies drain before the slots can be freed
        self.copy_stream.synchronize()
