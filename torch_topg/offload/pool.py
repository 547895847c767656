"""The bounded slot pool: ``prefetch_depth + 1`` buffers, each as large as the largest layer.

A layer's tensors are laid out in a slot back to back, each at an offset aligned to
the device allocator's alignment (64 bytes on the CPU, 512 on CUDA), so kernels see
the same alignment as for an ordinary tensor and pick the same code paths: the results
are bitwise those of the all-resident model. A slot is tagged with the layer it
holds and a generation number that changes on every reassignment: a stale tag can never
be mistaken for the current contents.
"""

from __future__ import annotations

import dataclasses
import enum
import threading

import torch

ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of a layer inside a slot."""

    name: str  # qualified name in the model (the source key)
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Read:
    """One page-aligned file region read into a slot by direct I/O (``direct.py``)."""

    file: int  # index into the source's files
    file_offset: int  # multiple of the page size
    slot_offset: int  # multiple of the page size
    nbytes: int  # multiple of the page size (may run past the end of the file)
    needed: int  # bytes that must arrive (the last tensor's end); a short tail is fine


@dataclasses.dataclass(frozen=True)
class SlotLayout:
    """Where each tensor of one layer lies in a slot."""

    entries: tuple[Entry, ...]
    nbytes: int  # end of the last tensor (the slot bytes this layer needs)
    payload: int  # sum of the tensors' bytes (what is copied)
    reads: tuple[Read, ...] = ()  # direct I/O only: the file regions to read

    @staticmethod
    def of(named: list[tuple[str, torch.Tensor]], align: int = ALIGN) -> SlotLayout:
        entries = []
        offset = 0
        payload = 0
        for name, t in named:
            offset = -(-offset // align) * align
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(name, offset, nbytes, t.dtype, tuple(t.shape)))
            offset += nbytes
            payload += nbytes
        return SlotLayout(tuple(entries), offset, payload)

    def views(self, buf: torch.Tensor) -> list[torch.Tensor]:
        """Typed views of ``buf`` (a flat uint8 slot buffer), one per entry."""
        return [
            buf[e.offset : e.offset + e.nbytes].view(e.dtype).view(e.shape) for e in self.entries
        ]


class State(enum.Enum):
    EMPTY = "empty"  # holds nothing valid
    LOADING = "loading"  # a copy is queued or running
    READY = "ready"  # holds `layer` (kept after a use too: a cache hit next time)
    FAILED = "failed"  # the copy for `layer` failed: `error` is raised at its use


class Slot:
    """One buffer of the pool and what it holds.

    ``done`` is set (in a ``finally``) when the copy for the current generation has
    finished or failed, so a waiter can never block forever; ``error`` holds a failure.
    """

    def __init__(self, index: int, buf: torch.Tensor) -> None:
        self.index = index
        self.buf = buf
        self.layer: int | None = None
        self.generation = 0
        self.state = State.EMPTY
        self.done = threading.Event()
        self.done.set()
        self.error: BaseException | None = None
        self.cancelled = False
        self.copying = False  # the reader is inside this slot's copy right now
        self.users = 0  # layers bound to it (wait without release yet)
        # device-specific state (CUDA events), owned by the backend
        self.backend_state: object = None

    def assign(self, layer: int) -> int:
        """Tag the slot for ``layer``; returns the new generation."""
        self.generation += 1
        self.layer = layer
        self.state = State.LOADING
        self.error = None
        self.cancelled = False
        self.done = threading.Event()
        return self.generation


class SlotPool:
    """``n`` slots of ``nbytes`` each, allocated once by ``alloc(nbytes)``."""

    def __init__(self, n: int, nbytes: int, alloc) -> None:  # type: ignore[no-untyped-def]
        self.nbytes = nbytes
        self.slots = [Slot(i, alloc(nbytes)) for i in range(n)]

    def holding(self, layer: int) -> Slot | None:
        for s in self.slots:
            if s.layer == layer and s.state is not State.EMPTY:
                return s
        return None

    @property
    def total_bytes(self) -> int:
        return self.nbytes * len(self.slots)
