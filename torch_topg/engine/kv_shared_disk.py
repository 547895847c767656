"""The disk KV tier shared by every engine on a host (``disk_kv_shared=True``).

Replicas of one model on one machine (``python -m torch_topg serve --replicas N``) each
have their own device and host tiers; a conversation routed to another replica would
recompute its whole prefix. With one folder as their common disk tier, a block demoted
by one replica is found by the others, so a conversation that moves keeps its prefix.

**Files.** One file per block: ``<chained hash, hex>-<fingerprint, hex>.kv``. The chained
hash names the tokens (and, through its root, the model); the fingerprint is that of the
cache's identity (model, dtype, block size, KV dtype, TP rank; the engine's
``cache_salt``), so engines of another model or layout sharing the folder never read
each other's blocks. A file is a 56-byte header (magic, fingerprint, hash, payload size,
CRC-32 of the payload) and the block's rows of every cache tensor, back to back.

**Atomic writes.** A block is written to ``.tmp-<pid>-<random>`` in the folder and renamed
onto its name (``os.replace``, atomic on POSIX): a reader sees a whole file or none. Two
engines writing one block race harmlessly (the contents are the same). A file that fails
its checks (short, wrong header, CRC) is a miss and is deleted: the block is recomputed.

**Eviction.** The folder has one size cap (``disk_kv_memory``). Each engine keeps an
estimate of the folder's size (a scan at start, plus what it wrote since); when its
estimate passes the cap it scans the folder and deletes the least recently used files
(oldest modification time: a read touches its file) down to 90% of the cap, so a full
folder costs one scan per tenth of the cap written, not one per block. Whichever
engine finds the cap exceeded evicts; deleting a file another engine deleted first is
not an error. Left-over temporary files (a writer killed mid-write) older than a minute
go in the same scan.

Each engine still keeps its own :class:`~torch_topg.engine.kv_tiers.TierIndex` of the
blocks it knows to be there (what it wrote and what it found); a hash missing from it
is looked up in the folder (:meth:`SharedDiskStore.has`) and adopted.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
import uuid
import zlib

import torch

from torch_topg.engine.kv_tiers import block_nbytes

_MAGIC = b"TOPGKV01"
_HEADER = struct.Struct("<8s16s16sQI4x")  # magic, fingerprint, hash, payload bytes, crc
HEADER_BYTES = _HEADER.size  # 56
LOW_WATER = 0.9  # eviction goes down to this share of the cap
TMP_MAX_AGE_S = 60.0


class SharedDiskStore:
    """Tier 3 as a folder of block files shared by the engines of one host."""

    kind = "disk"

    def __init__(
        self, caches: list[torch.Tensor], folder: str, cap_bytes: int, fingerprint: bytes
    ) -> None:
        self.folder = folder
        self.cap = cap_bytes
        self.fingerprint = fingerprint[:16].ljust(16, b"\0")
        self._suffix = f"-{self.fingerprint[:8].hex()}.kv"
        self.block_bytes = block_nbytes(caches)
        self.nbytes = cap_bytes
        self._sizes = [t[0].numel() * t.element_size() for t in caches]
        self.errors = 0
        self.evicted = 0  # files this engine deleted for the cap
        self.scans = 0
        self._estimate = self._scan_size()

    def path(self, key: bytes) -> str:
        return os.path.join(self.folder, key.hex() + self._suffix)

    def has(self, key: bytes) -> bool:
        return os.path.exists(self.path(key))

    def write(self, src: list[torch.Tensor], index: int, slot: int, key: bytes) -> None:
        """Write the block (rows ``index`` of ``src``) under ``key``, unless a file is
        there already (another engine wrote it: the same bytes); then the cap."""
        final = self.path(key)
        if os.path.exists(final):
            _touch(final)
            return
        payload = torch.cat([t[index].reshape(-1).view(torch.uint8) for t in src]).cpu().numpy()
        header = _HEADER.pack(_MAGIC, self.fingerprint, key, len(payload), zlib.crc32(payload))
        tmp = os.path.join(self.folder, f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, final)  # atomic: readers see all of it or nothing
        except OSError:
            self.errors += 1
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        self._estimate += len(header) + len(payload)
        if self._estimate > self.cap:
            self.evict()

    def read(self, slot: int, dst: list[torch.Tensor], index: int, key: bytes) -> bool:
        """Copy the block's file into ``dst``'s rows ``index``; False (nothing written) when
        it is gone or fails its checks (a failing file is deleted)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            self.errors += 1
            return False
        n = _HEADER.size
        ok = len(data) == n + self.block_bytes
        if ok:
            magic, fp, h, size, crc = _HEADER.unpack_from(data)
            payload = memoryview(data)[n:]
            ok = (magic, fp, h, size) == (_MAGIC, self.fingerprint, key, self.block_bytes)
            ok = ok and zlib.crc32(payload) == crc
        if not ok:
            self.errors += 1
            with contextlib.suppress(OSError):
                os.unlink(path)
            return False
        _touch(path)  # recently used: the cap evicts it last
        flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        off = 0
        for t, size in zip(dst, self._sizes, strict=True):
            t[index].reshape(-1).view(torch.uint8).copy_(flat[off : off + size])
            off += size
        return True

    def evict(self) -> None:
        """Scan the folder and delete the least recently used block files down to
        ``LOW_WATER`` of the cap (every engine's files: the cap is the folder's)."""
        files, total = self._entries()
        target = int(LOW_WATER * self.cap)
        if total > self.cap:
            files.sort()  # oldest first
            for _, size, path in files:
                if total <= target:
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                    self.evicted += 1
                total -= size  # gone either way (another engine may have deleted it)
        self._estimate = total

    def _entries(self) -> tuple[list[tuple[float, int, str]], int]:
        self.scans += 1
        files: list[tuple[float, int, str]] = []
        total = 0
        now = time.time()
        with os.scandir(self.folder) as it:
            for e in it:
                try:
                    st = e.stat()
                except FileNotFoundError:
                    continue
                if e.name.startswith(".tmp-"):
                    if now - st.st_mtime > TMP_MAX_AGE_S:  # a writer died mid-write
                        with contextlib.suppress(OSError):
                            os.unlink(e.path)
                    continue
                if e.name.endswith(".kv"):
                    files.append((st.st_mtime, st.st_size, e.path))
                    total += st.st_size
        return files, total

    def _scan_size(self) -> int:
        return self._entries()[1]

    def close(self) -> None:
        """Nothing to release: the files outlive the engine (that is the point)."""


def _touch(path: str) -> None:
    with contextlib.suppress(OSError):
        os.utime(path)
