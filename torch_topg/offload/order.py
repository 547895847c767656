"""The layer order, learned from the forwards themselves rather than from module order.

Each top-level forward records the sequence of offloaded-layer entries (repeats and
skips included). When a forward completes, its sequence becomes the predicted order for
the next one. Before the first forward completes the module order is the guess; a
mispredicted layer is simply fetched synchronously (correct, just not overlapped).
"""

from __future__ import annotations


class LayerOrder:
    def __init__(self, n_layers: int, offloaded: list[int]) -> None:
        self.n_layers = n_layers
        self.sequence: list[int] = list(offloaded)  # the guess until a forward completes
        self.learned = False
        self.pos = 0  # index in `sequence` of the next expected entry
        self._recording: list[int] | None = None

    def begin_forward(self) -> None:
        self.pos = 0
        self._recording = []

    def end_forward(self) -> None:
        rec = self._recording
        self._recording = None
        if rec:
            self.sequence = rec
            self.learned = True
        self.pos = 0

    def enter(self, layer: int) -> bool:
        """Record that ``layer`` starts; move the cursor past it. True if it was predicted."""
        if self._recording is not None:
            self._recording.append(layer)
        seq = self.sequence
        if not seq:
            return False
        n = len(seq)
        if seq[self.pos % n] == layer:
            self.pos = self.pos % n + 1
            return True
        # skipped ahead (or back): resynchronise at the next occurrence, cyclically
        for k in range(1, n + 1):
            j = (self.pos + k) % n
            if seq[j] == layer:
                self.pos = j + 1
                return False
        return False  # a layer the order has never seen: the cursor stays

    def upcoming(self, count: int) -> list[int]:
        """The next ``count`` distinct layers expected, in order (wrapping into the next
        forward, which starts the sequence again)."""
        out: list[int] = []
        seq = self.sequence
        n = len(seq)
        for k in range(n):
            if len(out) >= count:
                break
            layer = seq[(self.pos + k) % n]
            if layer not in out:
                out.append(layer)
        return out
