"""The lower KV tiers: a host-memory pool (tier 2) and a file-backed pool (tier 3).

A tier holds whole KV blocks that the device pool evicted, under their prefix hashes
(:mod:`torch_topg.engine.kv_cache` decides what moves where); the host tier also holds
the *parked* KV of sequences preempted under the priority policy (slots with no hash,
never evicted, freed when the sequence comes back or ends). A block is the same rows
of every cache tensor of the model runner (``kv_caches[i][block]``: K and V of every
layer, and the scales of an int8 cache), so a tier copies those rows and nothing else
about the layout.

- :class:`HostStore`: one tensor per cache tensor, ``[slots, *block_shape]``, pinned when
  the device is CUDA (the copies are then DMA transfers). On the CPU it is the same DRAM
  as the device pool: the tier runs the same code there (and is tested), it gains
  nothing.
- :class:`DiskStore`: one file of ``slots`` fixed-size records (a block's rows of every
  tensor, back to back), written with ``pwrite`` and read with ``pread``; each record's
  CRC-32 is kept in memory and checked on read, so a torn or corrupted record (or an
  I/O error) is a miss, never wrong KV: the block is recomputed. The file is created
  for this engine and deleted at shutdown; nothing is reused across processes.
- :class:`~torch_topg.engine.kv_shared_disk.SharedDiskStore` (``disk_kv_shared=True``):
  the disk tier as a folder that every engine on the host reads and writes, one file
  per block (its own module).

:class:`TierIndex` is the bookkeeping both share: free slots, occupied slots in LRU
order with their hashes, and pins (a slot being promoted cannot be evicted).
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections import OrderedDict

import torch

from torch_topg.engine.kv_events import KVEventLog


class TierIndex:
    """Slots of one lower tier: free, or holding the block of one prefix hash.

    With an event log, a hash entering (:meth:`fill`) or leaving (:meth:`release`) the
    tier is recorded under the tier's ``medium`` (:mod:`torch_topg.engine.kv_events`)."""

    def __init__(self, name: str, num_slots: int) -> None:
        self.name = name
        self.num_slots = num_slots
        self.log: KVEventLog | None = None
        self.medium = name.upper()
        self._free = list(range(num_slots - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()  # occupied and not pinned
        self.hash_of: list[bytes | None] = [None] * num_slots
        self.by_hash: dict[bytes, int] = {}
        self.session: list[str | None] = [None] * num_slots
        self.pinned: set[int] = set()
        self.parked: set[int] = set()  # a preempted sequence's KV (no hash, not evictable)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def lookup(self, h: bytes) -> int | None:
        return self.by_hash.get(h)

    def has_free(self) -> bool:
        return bool(self._free)

    def take_free(self) -> int:
        return self._free.pop()

    def fill(self, slot: int, h: bytes, session: str | None) -> None:
        if h in self.by_hash:
            raise RuntimeError(f"{self.name} tier: hash already held by slot {self.by_hash[h]}")
        self.hash_of[slot] = h
        self.by_hash[h] = slot
        self.session[slot] = session
        self.lru[slot] = None
        if self.log is not None:
            self.log.stored([h], None, [], self.medium)

    def pin(self, slot: int) -> None:
        del self.lru[slot]
        self.pinned.add(slot)

    def unpin(self, slot: int) -> None:
        self.pinned.discard(slot)
        self.lru[slot] = None

    def release(self, slot: int) -> None:
        """Forget the slot's block (pinned, parked or not) and free the slot."""
        self.pinned.discard(slot)
        self.parked.discard(slot)
        self.lru.pop(slot, None)
        h = self.hash_of[slot]
        if h is not None:
            del self.by_hash[h]
            if self.log is not None:
                self.log.removed([h], self.medium)
        self.hash_of[slot] = None
        self.session[slot] = None
        self._free.append(slot)

    def check(self) -> None:
        occupied = set(self.lru) | self.pinned
        held = occupied | self.parked
        if held & set(self._free) or len(held) + len(self._free) != self.num_slots:
            raise AssertionError(f"{self.name} tier: slots lost or listed twice")
        if self.parked & occupied or any(self.hash_of[s] is not None for s in self.parked):
            raise AssertionError(f"{self.name} tier: a parked slot is also a cached block")
        if len(set(self._free)) != len(self._free):
            raise AssertionError(f"{self.name} tier: a free slot is listed twice")
        for s in occupied:
            h = self.hash_of[s]
            if h is None or self.by_hash.get(h) != s:
                raise AssertionError(f"{self.name} tier: slot {s} and the hash index disagree")
        if len(self.by_hash) != len(occupied):
            raise AssertionError(f"{self.name} tier: stale hashes in the index")


def block_nbytes(caches: list[torch.Tensor]) -> int:
    """Bytes of one block: its rows of every cache tensor."""
    return sum(t[0].numel() * t.element_size() for t in caches)


def _row_bytes(t: torch.Tensor, i: int) -> torch.Tensor:
    """Row ``i`` of ``t`` as a flat uint8 view (no copy)."""
    return t[i].reshape(-1).view(torch.uint8)


class HostStore:
    """Tier 2: a copy of the cache layout in host memory, ``slots`` blocks deep."""

    kind = "host"

    def __init__(self, caches: list[torch.Tensor], slots: int) -> None:
        pin = caches[0].device.type == "cuda"
        self.tensors = [
            torch.empty((slots, *t.shape[1:]), dtype=t.dtype, device="cpu", pin_memory=pin)
            for t in caches
        ]
        self.block_bytes = block_nbytes(caches)
        self.nbytes = self.block_bytes * slots

    def write(self, src: list[torch.Tensor], index: int, slot: int, key: bytes = b"") -> None:
        for h, t in zip(self.tensors, src, strict=True):
            h[slot].copy_(t[index])

    def read(self, slot: int, dst: list[torch.Tensor], index: int, key: bytes = b"") -> bool:
        for h, t in zip(self.tensors, dst, strict=True):
            t[index].copy_(h[slot])
        return True

    def close(self) -> None:
        self.tensors = []


class DiskStore:
    """Tier 3: fixed-size records in one file under ``folder``, CRC-checked on read."""

    kind = "disk"

    def __init__(self, caches: list[torch.Tensor], slots: int, folder: str) -> None:
        self.block_bytes = block_nbytes(caches)
        self.nbytes = self.block_bytes * slots
        self._sizes = [t[0].numel() * t.element_size() for t in caches]
        fd, self.path = tempfile.mkstemp(prefix="topg-kv-", suffix=".bin", dir=folder)
        self.fd = fd
        os.ftruncate(fd, self.nbytes)  # sparse: pages are taken as records are written
        self._crc: list[int | None] = [None] * slots
        self.errors = 0

    def write(self, src: list[torch.Tensor], index: int, slot: int, key: bytes = b"") -> None:
        buf = torch.cat([_row_bytes(t, index) for t in src]).cpu().numpy()
        self._crc[slot] = None
        try:
            n = os.pwrite(self.fd, buf, slot * self.block_bytes)
        except OSError:
            n = -1
        if n == len(buf):
            self._crc[slot] = zlib.crc32(buf)
        else:
            self.errors += 1  # read() will find no checksum: a miss

    def read(self, slot: int, dst: list[torch.Tensor], index: int, key: bytes = b"") -> bool:
        """Copy the record into ``dst``'s rows ``index``; False (nothing written) when the
        record cannot be read or fails its checksum."""
        crc = self._crc[slot]
        try:
            data = os.pread(self.fd, self.block_bytes, slot * self.block_bytes)
        except OSError:
            data = b""
        if crc is None or len(data) != self.block_bytes or zlib.crc32(data) != crc:
            self.errors += 1
            return False
        flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        off = 0
        for t, n in zip(dst, self._sizes, strict=True):
            _row_bytes(t, index).copy_(flat[off : off + n])
            off += n
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
            try:
                os.unlink(self.path)
            except OSError:
                pass


def check_disk_folder(path: str | os.PathLike[str]) -> str:
    """``disk_kv_path``: an existing writable folder (a clear error otherwise)."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"disk_kv_path: {folder!r} is not an existing folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".topg-probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"disk_kv_path: cannot create files in {folder!r}: {e}") from None
    return folder
