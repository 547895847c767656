"""The background reader: one thread that performs every copy into the pool, in order.

All copies (prefetches and the synchronous fetch of a mispredicted layer, which is put
at the front of the queue) go through this one thread, so an emulated storage bandwidth
(``read_bandwidth``) applies to all of them, as it would to one real device.

The CPU copy is ``ctypes.memmove`` per chunk: it releases the GIL and runs on this
thread alone (a torch ``copy_`` of a large tensor would use the intra-op thread pool and
compete with the compute threads for the same cores). Reading from a memory map in this
thread is also what moves the page faults, i.e. the storage reads, off the compute thread.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from torch_topg.offload.pool import Slot, SlotLayout, State

CHUNK = 4 << 20  # bytes per copy step: the granularity of throttling and of stopping


class Cancelled(Exception):
    """The copy was abandoned because the handle is closing (not an error)."""


@dataclasses.dataclass
class Job:
    slot: Slot
    generation: int
    layer: int
    name: str
    layout: SlotLayout
    sources: list[torch.Tensor]
    done: threading.Event


class Throttle:
    """Makes a sequence of copies take at least ``bytes / bandwidth`` seconds."""

    def __init__(self, bandwidth: float | None) -> None:
        self.bandwidth = bandwidth

    def pace(self, t0: float, nbytes: int, stop: threading.Event) -> None:
        if not self.bandwidth:
            return
        delay = t0 + nbytes / self.bandwidth - time.perf_counter()
        if delay > 0 and stop.wait(delay):  # wakes early when closing
            raise Cancelled


def host_copy(dst: torch.Tensor, src: torch.Tensor, nbytes: int) -> None:
    """memmove ``nbytes`` from ``src`` to ``dst`` (both host memory, contiguous)."""
    if nbytes:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)


def chunks(layout: SlotLayout, sources: list[torch.Tensor]):  # type: ignore[no-untyped-def]
    """(slot offset, flat uint8 source chunk) pairs covering a layer, CHUNK bytes each."""
    for e, src in zip(layout.entries, sources, strict=True):
        flat = src.reshape(-1).view(torch.uint8)
        for a in range(0, e.nbytes, CHUNK):
            yield e.offset + a, flat[a : a + CHUNK]


class CpuBackend:
    """The pool lives in host memory; a copy is a chunked memmove."""

    name = "cpu"
    io = "mmap"
    align = 64  # the CPU allocator's alignment

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def prepare_source(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def copy(self, job: Job, throttle: Throttle, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        moved = 0
        for off, src in chunks(job.layout, job.sources):
            if stop.is_set():
                raise Cancelled
            host_copy(job.slot.buf[off:], src, src.numel())
            moved += src.numel()
            throttle.pace(t0, moved, stop)

    def before_use(self, slot: Slot) -> None:
        pass

    def after_use(self, slot: Slot) -> None:
        pass

    def close(self) -> None:
        pass


class Reader:
    """Runs the copy jobs of an engine on one daemon thread.

    ``on_done(job, error, seconds, copied)`` is called with the engine lock held after
    each job; the job's ``done`` event is set in a ``finally`` after that, whatever
    happened, so ``wait()`` in the compute thread can never block forever.
    """

    def __init__(
        self,
        backend,  # type: ignore[no-untyped-def]
        lock: threading.RLock,
        on_done: Callable[[Job, BaseException | None, float, bool], None],
        bandwidth: float | None,
        before_copy: Callable[[int], None] | None = None,
    ) -> None:
        self.backend = backend
        self.lock = lock
        self.on_done = on_done
        self.throttle = Throttle(bandwidth)
        self.before_copy = before_copy  # test hook: delays and injected errors
        self.jobs: collections.deque[Job] = collections.deque()
        self.wake = threading.Condition(lock)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="topg-offload-reader", daemon=True)
        self.thread.start()

    def submit(self, job: Job, urgent: bool = False) -> None:
        """Queue ``job`` (caller holds the lock); ``urgent`` puts it first."""
        if urgent:
            self.jobs.appendleft(job)
        else:
            self.jobs.append(job)
        self.wake.notify()

    def promote(self, slot: Slot) -> None:
        """Move the queued job of ``slot`` to the front (caller holds the lock)."""
        for job in list(self.jobs):
            if job.slot is slot:
                self.jobs.remove(job)
                self.jobs.appendleft(job)
                return

    def cancel(self, slot: Slot) -> bool:
        """Drop the queued job of ``slot`` (caller holds the lock). False if it is running."""
        if slot.copying:
            return False
        for job in list(self.jobs):
            if job.slot is slot:
                self.jobs.remove(job)
                job.done.set()
        slot.cancelled = True
        return True

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.jobs and not self.stop.is_set():
                    self.wake.wait()
                if self.stop.is_set():
                    return
                job = self.jobs.popleft()
                job.slot.copying = True
            error: BaseException | None = None
            copied = False
            t0 = time.perf_counter()
            try:
                if self.before_copy is not None:
                    self.before_copy(job.layer)
                self.backend.copy(job, self.throttle, self.stop)
                copied = True
            except Cancelled as e:
                error = e
            except BaseException as e:  # re-raised at wait() of this layer
                error = e
            finally:
                try:
                    with self.lock:
                        job.slot.copying = False
                        self.on_done(job, error, time.perf_counter() - t0, copied)
                finally:
                    job.done.set()

    def close(self) -> None:
        """Stop the thread (a copy in progress stops at its next chunk) and join it."""
        with self.lock:
            self.stop.set()
            for job in self.jobs:
                job.slot.state = State.EMPTY
                job.done.set()
            self.jobs.clear()
            self.wake.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()
