"""KV events: which prefix blocks an engine's KV hierarchy holds, in vLLM's event format.

An engine built with ``kv_events=True`` records an event whenever a chained block hash
(:func:`torch_topg.engine.kv_cache.chain_hash`) enters or leaves one of its tiers. A
router that reads them knows which replica holds which prefix (``torch_topg.cluster``).

The events are vLLM's (``vllm/distributed/kv_events.py``), field for field, so a router
written for vLLM can read them:

- ``BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)``:
  a run of consecutive blocks of one chain; ``parent_block_hash`` is the hash before the
  first one (None at a prompt's start). A block demoted to a lower tier is announced
  with its hash alone (``token_ids`` empty, parent None): the tier keeps no tokens.
- ``BlockRemoved(block_hashes, medium)``; ``AllBlocksCleared()``.
- ``KVEventBatch(ts, events, data_parallel_rank)``.

On the wire (:func:`encode`) a batch is msgpack exactly as vLLM 0.33's publisher encodes
its msgspec structs: the batch array-like, the events maps tagged by ``"type"``:
``[ts, [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
"token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name":
None}, ...], data_parallel_rank]`` (the rank left out while None, as ``omit_defaults``
does). Hashes are 16 bytes (msgpack bin). :func:`decode` also reads the array-like
events of earlier vLLM releases. ``kv_publisher.py`` sends the batches on a ZMQ PUB
socket, as vLLM's ``"zmq"`` publisher does.

``medium`` names the tier: the device pool is ``"GPU"`` on CUDA and ``"CPU"`` on the
CPU; the host tier ``"CPU"`` beside a CUDA pool and ``"HOST"`` beside a CPU pool (so
the two never share a name); the disk tier ``"DISK"``. A hash lives in one tier at a
time, so moving a block between tiers is a ``BlockStored`` in the new medium and a
``BlockRemoved`` in the old.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    medium: str | None = None


@dataclass
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def mediums(device_type: str) -> dict[str, str]:
    """The ``medium`` of each tier (device, host, disk) for a pool on ``device_type``."""
    cuda = device_type == "cuda"
    return {"device": "GPU" if cuda else "CPU", "host": "CPU" if cuda else "HOST", "disk": "DISK"}


# --- the wire format -----------------------------------------------------------------
def to_wire(batch: KVEventBatch) -> list[Any]:
    """The batch as vLLM 0.33's msgspec structs encode it, as plain msgpack values: the
    batch array-like ``[ts, events(, data_parallel_rank)]``, each event a map tagged by
    ``"type"`` with its fields in declaration order (the fields vLLM gives a default,
    ``extra_keys``, ``group_idx``, ..., are left out, as ``omit_defaults`` does for
    their default)."""
    events: list[Any] = []
    for e in batch.events:
        if isinstance(e, BlockStored):
            events.append({"type": "BlockStored", "block_hashes": list(e.block_hashes),
                           "parent_block_hash": e.parent_block_hash,
                           "token_ids": list(e.token_ids), "block_size": e.block_size,
                           "lora_id": e.lora_id, "medium": e.medium, "lora_name": None})  # fmt: skip
        elif isinstance(e, BlockRemoved):
            events.append({"type": "BlockRemoved", "block_hashes": list(e.block_hashes),
                           "medium": e.medium})  # fmt: skip
        elif isinstance(e, AllBlocksCleared):
            events.append({"type": "AllBlocksCleared"})
        else:
            raise TypeError(f"to_wire: not a KV event: {e!r}")
    out: list[Any] = [batch.ts, events]
    if batch.data_parallel_rank is not None:
        out.append(batch.data_parallel_rank)
    return out


def _event(e: Any) -> KVEvent:
    """One event: a tagged map (vLLM 0.33), or a tagged array (earlier vLLM releases,
    whose events were ``array_like``: ``["BlockStored", hashes, parent, ...]``)."""
    if isinstance(e, dict):
        tag, get = e.get("type"), e.get
        if tag == "BlockStored" and "block_hashes" in e and "block_size" in e:
            return BlockStored([bytes(h) if isinstance(h, bytes | bytearray) else h
                                for h in e["block_hashes"]], get("parent_block_hash"),
                               list(get("token_ids") or []), int(e["block_size"]),
                               get("lora_id"), get("medium"))  # fmt: skip
        if tag == "BlockRemoved" and "block_hashes" in e:
            return BlockRemoved(list(e["block_hashes"]), get("medium"))
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    elif isinstance(e, list | tuple) and e:
        tag = e[0]
        if tag == "BlockStored" and len(e) >= 5:
            return BlockStored(list(e[1]), e[2], list(e[3]), int(e[4]),
                               e[5] if len(e) > 5 else None, e[6] if len(e) > 6 else None)  # fmt: skip
        if tag == "BlockRemoved" and len(e) >= 2:
            return BlockRemoved(list(e[1]), e[2] if len(e) > 2 else None)
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
    raise ValueError(f"KV event batch: unknown or malformed event {e!r:.80}")


def from_wire(data: list[Any]) -> KVEventBatch:
    """The inverse of :func:`to_wire` (a ValueError naming what is malformed)."""
    if not isinstance(data, list | tuple) or len(data) not in (2, 3):
        raise ValueError(f"KV event batch: expected [ts, events(, rank)], got {data!r:.80}")
    rank = data[2] if len(data) == 3 else None
    return KVEventBatch(float(data[0]), [_event(e) for e in data[1]], rank)


def encode(batch: KVEventBatch) -> bytes:
    """msgpack bytes of the batch, as vLLM's ``ZmqEventPublisher`` sends its payload."""
    import msgpack  # Ray's dependency: the cluster extra has it

    return msgpack.packb(to_wire(batch), use_bin_type=True)


def decode(data: bytes) -> KVEventBatch:
    import msgpack

    return from_wire(msgpack.unpackb(data, raw=False))


# --- the engine's log ----------------------------------------------------------------
class KVEventLog:
    """The events an engine recorded, numbered, for consumers that poll them.

    The engine loop appends; any thread reads with :meth:`since`. The log keeps the last
    ``capacity`` events: a consumer further behind is told to start over (its view of
    this engine is then rebuilt from the events that follow, see ``since``).
    """

    def __init__(self, block_size: int, capacity: int = 100_000) -> None:
        self.block_size = block_size
        self._events: deque[KVEvent] = deque(maxlen=capacity)
        self._next = 0  # number of the next event appended
        self._lock = threading.Lock()

    def _add(self, e: KVEvent) -> None:
        with self._lock:
            self._events.append(e)
            self._next += 1

    def stored(
        self, hashes: list[bytes], parent: bytes | None, tokens: list[int], medium: str
    ) -> None:
        if hashes:
            self._add(
                BlockStored(list(hashes), parent, list(tokens), self.block_size, None, medium)
            )

    def removed(self, hashes: list[bytes], medium: str) -> None:
        if hashes:
            self._add(BlockRemoved(list(hashes), medium))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    @property
    def cursor(self) -> int:
        """The number the next event will have."""
        with self._lock:
            return self._next

    def since(self, cursor: int) -> tuple[int, KVEventBatch]:
        """``(new cursor, batch of the events numbered >= cursor)``. A cursor older than
        the log's first event gets an ``AllBlocksCleared`` first: the consumer forgets
        what it knew of this engine, and what it missed is not announced again."""
        with self._lock:
            first = self._next - len(self._events)
            if cursor < first or cursor > self._next:
                events: list[KVEvent] = [AllBlocksCleared(), *self._events]
            else:
                events = list(self._events)[cursor - first :]
            return self._next, KVEventBatch(time.time(), events)
