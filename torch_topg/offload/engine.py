"""The prefetch engine shared by the CPU and CUDA paths: slot scheduling, wait/release,
the learned order and the statistics. What differs per device (allocation, the copy,
the stream synchronisation around a use) is the backend's (``reader.CpuBackend``,
``cuda.CudaBackend``).

Invariants (all state changes happen under ``self.lock``):
* a slot is written only by the reader, only while its state is LOADING and no layer
  uses it (``users == 0``);
* a layer's tensors point into a slot only between ``wait(i)`` and ``release(i)``; at
  any other time they point at a placeholder (NaN for floats), never at another
  layer's data;
* ``wait(i)`` returns only after the copy of the slot's current generation finished;
  an error of that copy is raised there, naming the layer.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import torch

from torch_topg.offload.order import LayerOrder
from torch_topg.offload.pool import Slot, SlotLayout, SlotPool, State
from torch_topg.offload.reader import Cancelled, Job, Reader


@dataclasses.dataclass
class LayerInfo:
    index: int
    name: str  # module path, e.g. "model.layers.3"
    tensors: list[torch.Tensor]  # the Parameter / buffer objects rebound at each use
    sources: list[torch.Tensor]  # host tensors copied from, in layout order
    layout: SlotLayout
    placeholders: list[torch.Tensor]
    slot: Slot | None = None  # the slot bound between wait and release
    # called by the reader before each copy of this layer: raises if its source file
    # was truncated since it was opened (copying from the map would end in SIGBUS)
    check: Callable[[], None] | None = None


@dataclasses.dataclass
class FaultHooks:
    """Fault injection for the hazard tests: called in the reader before each copy and
    in the compute thread after a layer's weights are bound."""

    before_copy: Callable[[int], None] | None = None
    after_bind: Callable[[int], None] | None = None


def placeholder(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A stand-in on ``device`` with ``t``'s shape and dtype backed by one element: NaN
    for floating types, so a use outside wait/release shows up instead of computing
    with old data."""
    fill = float("nan") if (t.is_floating_point() or t.is_complex()) else 0
    return torch.full((), fill, dtype=t.dtype, device=device).expand(t.shape)


class Engine:
    def __init__(
        self,
        layers: list[LayerInfo],
        n_layers: int,
        backend,  # type: ignore[no-untyped-def]
        depth: int,
        read_bandwidth: float | None,
        resident_bytes: int,
        hooks: FaultHooks | None = None,
    ) -> None:
        self.layers = {info.index: info for info in layers}
        self.backend = backend
        self.depth = depth
        self.hooks = hooks or FaultHooks()
        # re-entrant: a garbage collection inside a locked region may run the finalizer
        # of this very handle (close() takes the lock) on the same thread
        self.lock = threading.RLock()
        self.closed = False
        self.order = LayerOrder(n_layers, [info.index for info in layers])
        largest = max((info.layout.nbytes for info in layers), default=0)
        self.pool = SlotPool(depth + 1, largest, backend.alloc)
        self.largest_layer_bytes = max((info.layout.payload for info in layers), default=0)
        self.resident_bytes = resident_bytes
        # statistics
        self.bytes_moved = 0
        self.read_s = 0.0
        self.stall_s = 0.0
        self.sync_fetches = 0
        self.fetches = {i: 0 for i in self.layers}
        self.peak_resident = resident_bytes
        self.reader = Reader(backend, self.lock, self._copy_done, read_bandwidth, self._before_copy)

    # ---------------------------------------------------------------- reader side
    def _before_copy(self, layer: int) -> None:
        if self.hooks.before_copy is not None:
            self.hooks.before_copy(layer)
        check = self.layers[layer].check
        if check is not None:
            check()

    def _copy_done(self, job: Job, error: BaseException | None, seconds: float, ok: bool) -> None:
        """Called by the reader with the lock held."""
        slot = job.slot
        self.read_s += seconds
        if ok:
            self.bytes_moved += job.layout.payload
            self.fetches[job.layer] += 1
        if slot.generation != job.generation:
            return  # reassigned meanwhile (cannot happen while copying; defensive)
        if error is None:
            slot.state = State.READY
        elif isinstance(error, Cancelled):
            slot.state = State.EMPTY
        else:  # kept (not re-read) until the layer's use, which raises it
            slot.state = State.FAILED
            slot.error = error

    # ---------------------------------------------------------------- scheduling
    def _resident_now(self) -> int:
        held = sum(
            self.layers[s.layer].layout.payload
            for s in self.pool.slots
            if s.state in (State.LOADING, State.READY) and s.layer is not None
        )
        return self.resident_bytes + held

    def _note_peak(self) -> None:
        self.peak_resident = max(self.peak_resident, self._resident_now())

    def _victim(self, keep: list[int], allow_copying: bool) -> Slot | None:
        """A slot no layer uses whose contents are not needed by ``keep`` (the upcoming
        window): empty first, then the one holding a layer needed furthest ahead."""
        best: Slot | None = None
        best_rank = -1
        for s in self.pool.slots:
            if s.users or (s.copying and not allow_copying):
                continue
            if s.state is State.EMPTY:
                return s
            rank = len(keep) + 1 if s.layer not in keep else keep.index(s.layer)
            if rank > best_rank:
                best, best_rank = s, rank
        return best

    def _assign(self, slot: Slot, layer: int, urgent: bool) -> None:
        if slot.state is State.LOADING:
            self.reader.cancel(slot)
        info = self.layers[layer]
        gen = slot.assign(layer)
        self._note_peak()
        job = Job(slot, gen, layer, info.name, info.layout, info.sources, slot.done)
        self.reader.submit(job, urgent=urgent)

    def start(self) -> None:
        """Start reading the first ``depth`` layers (``offload()`` calls it once the
        model's hooks are installed)."""
        with self.lock:
            self._schedule()

    def _schedule(self) -> None:
        """Fill the pool with the next ``depth`` layers of the predicted order."""
        if self.closed or self.depth == 0:
            return
        window = self.order.upcoming(self.depth)
        for j in window:
            if self.pool.holding(j) is not None:
                continue
            slot = self._victim(window, allow_copying=False)
            if slot is None or (slot.layer in window and slot.state is not State.EMPTY):
                return  # every free slot holds a layer needed sooner
            self._assign(slot, j, urgent=False)

    # ---------------------------------------------------------------- compute side
    def _info(self, i: int, what: str) -> LayerInfo:
        if self.closed:
            raise RuntimeError(f"offload: {what}({i}) on a closed handle")
        try:
            return self.layers[i]
        except KeyError:
            raise ValueError(
                f"offload: {what}: layer {i} is not offloaded (offloaded: {sorted(self.layers)})"
            ) from None

    def prefetch(self, i: int) -> None:
        """Start reading layer ``i`` now if it is not in the pool (never blocks)."""
        with self.lock:
            self._info(i, "prefetch")
            if self.pool.holding(i) is None:
                # evict what the predicted order needs last
                slot = self._victim(self.order.upcoming(self.depth), allow_copying=False)
                if slot is not None:
                    self._assign(slot, i, urgent=False)

    def wait(self, i: int) -> None:
        """Bind layer ``i``'s tensors to its slot once its copy has finished."""
        t0 = time.perf_counter()
        with self.lock:
            self._info(i, "wait")
            self.order.enter(i)
        while True:
            with self.lock:
                info = self._info(i, "wait")
                if info.slot is not None:
                    raise RuntimeError(f"offload: layer {i} ({info.name}) is already in use")
                slot = self.pool.holding(i)
                if slot is None:
                    victim = self._victim(self.order.upcoming(self.depth), allow_copying=False)
                    if victim is None:
                        busy = self._victim([], allow_copying=True)
                        if busy is None:
                            raise RuntimeError(
                                f"offload: no free slot for layer {i} ({info.name}): all "
                                f"{len(self.pool.slots)} slots are in use"
                            )
                        done = busy.done  # a copy into the only candidate: let it finish
                    else:
                        self.sync_fetches += 1
                        self._assign(victim, i, urgent=True)
                        slot = victim
                elif slot.state is State.LOADING:
                    self.reader.promote(slot)  # needed now: ahead of later prefetches
                if slot is not None:
                    slot.users += 1
                    info.slot = slot
                    gen = slot.generation
                    done = slot.done
                    self._schedule()
            if slot is not None:
                break
            done.wait()
        done.wait()
        with self.lock:
            self.stall_s += time.perf_counter() - t0
            if slot.state is not State.READY or slot.generation != gen or slot.layer != i:
                err = slot.error
                slot.users -= 1
                info.slot = None
                if slot.users == 0 and slot.generation == gen:
                    slot.state = State.EMPTY
                    slot.error = None
                if self.closed:
                    raise RuntimeError(f"offload: handle closed while waiting for layer {i}")
                raise RuntimeError(
                    f"offload: reading the weights of layer {i} ({info.name}) failed: "
                    f"{type(err).__name__}: {err}"
                ) from err
        self.backend.before_use(slot)
        for t, v in zip(info.tensors, info.layout.views(slot.buf), strict=True):
            t.data = v
        if self.hooks.after_bind is not None:
            try:
                self.hooks.after_bind(i)
            except BaseException:
                self.release(i)
                raise

    def release(self, i: int) -> None:
        """Point layer ``i``'s tensors back at placeholders; its slot may be reused (its
        contents stay valid until then: using the layer again soon is a cache hit)."""
        with self.lock:
            info = self.layers[i]
            slot = info.slot
            if slot is None:
                return
            for t, p in zip(info.tensors, info.placeholders, strict=True):
                t.data = p
            self.backend.after_use(slot)
            slot.users -= 1
            info.slot = None
            self._schedule()

    def begin_forward(self) -> None:
        with self.lock:
            self.order.begin_forward()
            self._schedule()

    def end_forward(self) -> None:
        with self.lock:
            self.order.end_forward()
            self._schedule()

    # ---------------------------------------------------------------- stats, close
    def stats(self) -> dict[str, object]:
        with self.lock:
            read = self.read_s
            return {
                "bytes_moved": self.bytes_moved,
                "read_s": read,
                "stall_s": self.stall_s,
                "overlap": max(0.0, min(1.0, 1.0 - self.stall_s / read)) if read > 0 else 1.0,
                "peak_resident_bytes": self.peak_resident,
                "resident_now_bytes": self._resident_now(),
                "bound_bytes": (self.depth + 1) * self.largest_layer_bytes + self.resident_bytes,
                "largest_layer_bytes": self.largest_layer_bytes,
                "pool_bytes": self.pool.total_bytes,
                "fetches": dict(self.fetches),
                "sync_fetches": self.sync_fetches,
                "order": list(self.order.sequence),
                "order_learned": self.order.learned,
            }

    def reset_stats(self) -> None:
        with self.lock:
            self.bytes_moved = 0
            self.read_s = self.stall_s = 0.0
            self.sync_fetches = 0
            self.fetches = {i: 0 for i in self.layers}
            self.peak_resident = self._resident_now()

    def close(self) -> None:
        """Stop the reader and join it; later waits raise. Idempotent."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.reader.close()
        with self.lock:
            for s in self.pool.slots:
                s.done.set()
        self.backend.close()
