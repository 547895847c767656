"""The KV events on a ZMQ PUB socket, as vLLM's ``"zmq"`` publisher sends them.

An engine built with ``kv_events_endpoint="tcp://*:5557"`` (vLLM's
``--kv-events-config '{"publisher": "zmq", "endpoint": ...}'``) publishes the events its
:class:`~torch_topg.engine.kv_events.KVEventLog` records, so a router written for vLLM's
stream (a SUB socket) can follow this engine too. Each message is three frames:

1. the topic (``kv_events_topic``, UTF-8; ``""`` by default, as vLLM's), which a
   subscriber filters on;
2. the sequence number, 8 bytes big-endian, counting from 0 with every message sent;
3. the batch, msgpack as vLLM 0.33 encodes a ``KVEventBatch``
   (:func:`torch_topg.engine.kv_events.encode`), ``data_parallel_rank`` 0.

An endpoint with ``*``, ``::``, ``ipc://`` or ``inproc://`` is bound, any other is
connected to (vLLM's rule: bind where the address is stable, connect to a collector).

Never in the engine's way: the engine loop hands each step's new events to
:meth:`ZmqEventPublisher.publish`, which only puts them on a bounded queue; a thread of
its own encodes and sends. A full queue (a subscriber-less socket does not fill it:
ZMQ drops for absent subscribers; a thread starved of CPU can) drops the batch and
counts it (:attr:`dropped`), where vLLM's publisher blocks the scheduler instead. The
next batch sent then starts with ``AllBlocksCleared``: a subscriber that missed events
forgets this engine's blocks and relearns them from what follows (it may then know too
little, never too much), as the pull transport does for a consumer too far behind.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

from torch_topg.engine.errors import ParameterError
from torch_topg.engine.kv_events import AllBlocksCleared, KVEventBatch, KVEventLog, encode

log = logging.getLogger("torch_topg.engine")

SCHEMES = ("tcp://", "ipc://", "inproc://")


def zmq_available() -> bool:
    """Whether pyzmq is installed (the ``cluster`` extra)."""
    try:
        import zmq  # noqa: F401
    except ImportError:
        return False
    return True


def binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard or local endpoint, connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """A PUB socket and the thread that feeds it from a bounded queue.

    ``max_queue_size`` batches wait at most (vLLM's default, 100,000); ``hwm`` is the
    socket's send high-water mark (ZMQ's own per-subscriber buffer, vLLM's default)."""

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        *,
        max_queue_size: int = 100_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        import zmq

        self.endpoint = endpoint
        self.topic = topic.encode("utf-8")
        self.data_parallel_rank = data_parallel_rank
        self.sent = 0  # batches sent: the next one's sequence number
        self.dropped = 0  # batches dropped on a full queue
        self.errors = 0  # sends that failed (logged)
        self._lost = False  # a batch was dropped since the last one queued
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.set_hwm(hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if binds(endpoint):
                self._sock.bind(endpoint)
            else:
                self._sock.connect(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise ParameterError("kv_events_endpoint", f"cannot use {endpoint!r}: {e}") from None
        #: the endpoint as bound (``tcp://*:0`` picks a free port: this says which)
        self.address = self._sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._thread = threading.Thread(target=self._run, name="topg-kv-events", daemon=True)
        self._thread.start()

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch`` for sending, never waiting; False (and counted) if dropped."""
        if self._lost:
            batch = KVEventBatch(batch.ts, [AllBlocksCleared(), *batch.events],
                                 batch.data_parallel_rank)  # fmt: skip
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.dropped += 1
            self._lost = True
            return False
        self._lost = False
        return True

    def _run(self) -> None:
        while True:
            batch = self._queue.get()
            if batch is None:
                return
            try:
                payload = encode(batch)
                seq = self.sent.to_bytes(8, "big")
                self._sock.send_multipart((self.topic, seq, payload), copy=False)
                self.sent += 1
            except Exception as e:  # a send that fails must not stop the publisher
                self.errors += 1
                log.warning("KV events: publishing to %s failed: %r", self.endpoint, e)

    def close(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout_s``), then close the socket."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._sock.close(linger=1000)  # what ZMQ still holds goes out meanwhile

    def stats(self) -> dict[str, Any]:
        return {"endpoint": self.address, "sent": self.sent, "dropped": self.dropped,
                "queued": self._queue.qsize(), "errors": self.errors}  # fmt: skip


class EventFeed:
    """The engine loop's end: after each pass, the log's new events as one batch to the
    publisher (one list slice; the encoding and the send are the publisher's thread's)."""

    def __init__(self, log: KVEventLog, publisher: ZmqEventPublisher) -> None:
        self.log, self.publisher = log, publisher
        self.cursor = log.cursor

    def pump(self) -> None:
        if self.log.cursor != self.cursor:
            self.cursor, batch = self.log.since(self.cursor)
            self.publisher.publish(batch)

    def close(self) -> None:
        self.pump()
        self.publisher.close()

    def stats(self) -> dict[str, Any]:
        return self.publisher.stats()


def event_feed(log: KVEventLog | None, endpoint: str | None, topic: str) -> EventFeed | None:
    """The feed of an engine with ``kv_events_endpoint`` (None without one)."""
    if endpoint is None or log is None:
        return None
    return EventFeed(log, ZmqEventPublisher(endpoint, topic))
