"""The KV events on ZMQ (``kv_events_endpoint``, vLLM's ``"zmq"`` publisher): a SUB socket
on the loopback receives, after requests, numbered msgpack batches that decode to exactly
the events the engine recorded in process; the payload holds the msgpack values vLLM 0.33
sends for the same batch; a full queue drops and counts, never blocks, and says so to the
subscriber. Skipped only where pyzmq (the ``cluster`` extra) is absent."""

from __future__ import annotations

import time

import msgpack  # the cluster extra (make test installs it): Ray's dependency
import pytest
import zmq  # the cluster extra: pyzmq
from engine_utils import prompts, tiny, wait_idle

from torch_topg.engine import Engine
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode,
    encode,
)

GREEDY = {"temperature": 0, "ignore_eos": True}

#: vLLM 0.33.0's encoding of the batch of ``_sample_batch()`` (its ``KVEventBatch`` of
#: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` structs, encoded by
#: ``msgspec.msgpack.Encoder`` as its ``ZmqEventPublisher`` does, data_parallel_rank 0),
#: made in the vLLM lane's environment; tests/vllm_lane/test_vllm_kv_events.py checks the
#: same against vLLM's own classes where vLLM is installed.
VLLM_BYTES = bytes.fromhex(
    "93cb3ff800000000000093de0008a474797065ab426c6f636b53746f726564ac626c6f636b5f686173"
    "68657392c41001010101010101010101010101010101c41002020202020202020202020202020202b1"
    "706172656e745f626c6f636b5f68617368c0a9746f6b656e5f6964739401020304aa626c6f636b5f73"
    "697a6504a76c6f72615f6964c0a66d656469756da3435055a96c6f72615f6e616d65c083a474797065"
    "ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c410010101010101010101010101"
    "01010101a66d656469756da4484f535481a474797065b0416c6c426c6f636b73436c656172656400"
)


def _sample_batch() -> KVEventBatch:
    stored = BlockStored([b"\x01" * 16, b"\x02" * 16], None, [1, 2, 3, 4], 4, None, "CPU")
    return KVEventBatch(1.5, [stored, BlockRemoved([b"\x01" * 16], "HOST"), AllBlocksCleared()], 0)


def test_payload_is_what_vllm_sends() -> None:
    """The same msgpack values as vLLM's bytes (msgspec writes an 8-entry map with a
    16-bit header where msgpack-python writes a fixmap: the one difference, the same
    value to every decoder), and vLLM's bytes decode to the batch."""
    ours = encode(_sample_batch())
    assert msgpack.unpackb(ours) == msgpack.unpackb(VLLM_BYTES)
    assert decode(VLLM_BYTES) == _sample_batch()
    # the array-like events of earlier vLLM releases still decode
    old = msgpack.packb([2.0, [["BlockRemoved", [b"\x03" * 16], "GPU"], ["AllBlocksCleared"]]])
    assert decode(old) == KVEventBatch(2.0, [BlockRemoved([b"\x03" * 16], "GPU"), AllBlocksCleared()])  # fmt: skip


class Subscriber:
    """The test's SUB socket and what it received: ``(topic, sequence, batch)``."""

    def __init__(self, sock) -> None:
        self.sock, self.got = sock, []

    def drain(self, until: int | None = None, timeout_s: float = 20.0) -> None:
        """Receive until ``until`` messages arrived (or nothing came for a moment)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if until is not None and len(self.got) >= until:
                return
            if self.sock.poll(50 if until is None else 200):
                topic, seq, payload = self.sock.recv_multipart()
                self.got.append((topic, int.from_bytes(seq, "big"), decode(payload)))
            elif until is None:
                return


def _engine(endpoint: str, **kw) -> Engine:
    return Engine.from_model(tiny("llama-tiny"), None, block_size=4, compile=False,
                             kv_cache_memory=12 * 4096, kv_events_endpoint=endpoint,
                             kv_events_topic="topg-test", **kw)  # fmt: skip


@pytest.mark.parametrize("how", ["engine connects", "engine binds"])
def test_subscriber_receives_the_engines_events(tmp_path, how) -> None:
    """Every batch arrives in order, numbered from 0, under the topic; decoded and
    concatenated they are the events the engine recorded (its in-process log)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"topg-test")
    if how == "engine connects":  # the collector binds on the loopback, the engine dials
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        endpoint = f"tcp://127.0.0.1:{port}"
    else:  # the engine binds (an ipc path: local, like tcp://*:5557 without the port)
        endpoint = f"ipc://{tmp_path}/kv-events"
        sub.connect(endpoint)
    s = Subscriber(sub)
    try:
        eng = _engine(endpoint)
        with eng:
            # a PUB socket drops what it sends before the subscription reaches it:
            # requests until the first batch arrives, then every later one must
            ps = prompts(7, [9] * 40, vocab=200)
            while not s.got:
                assert ps, "no KV event batch arrived after 40 requests"
                eng.generate(ps.pop(), max_new_tokens=2, **GREEDY)
                s.drain()
            wait_idle(eng)
            before = eng.kv.events.cursor
            # the real traffic: a long prompt, its prefix again, and evictions (a pool of 24
            # blocks: later prompts push earlier blocks out)
            long_prompt = prompts(11, [30], vocab=200)[0]
            eng.generate(long_prompt, max_new_tokens=3, **GREEDY)
            eng.generate([*long_prompt[:16], 5, 6, 7], max_new_tokens=3, **GREEDY)
            for p in prompts(13, [30, 30, 30], vocab=200):
                eng.generate(p, max_new_tokens=2, **GREEDY)
            wait_idle(eng)
        # shutdown sent what was left: every batch the publisher numbered must arrive
        st = eng.stats()["kv_events"]
        assert st["dropped"] == 0 and st["errors"] == 0
        s.drain(until=st["sent"] - s.got[0][1])
    finally:
        sub.close(linger=0)
    topics = {t for t, _, _ in s.got}
    seqs = [q for _, q, _ in s.got]
    assert topics == {b"topg-test"}
    assert seqs == list(range(seqs[0], st["sent"])), seqs  # in order, none lost
    assert all(b.data_parallel_rank == 0 for _, _, b in s.got)
    received = [e for _, _, b in s.got for e in b.events]
    recorded = eng.kv.events.since(0)[1].events  # the in-process list
    # the batches from the first one received on are the log's tail, event for event
    assert received == recorded[len(recorded) - len(received) :]
    after = recorded[before:]
    assert len(received) >= len(after)
    assert any(isinstance(e, BlockStored) and e.token_ids[:4] == long_prompt[:4] for e in after)
    assert any(isinstance(e, BlockRemoved) for e in after)


def test_full_queue_drops_counts_and_tells_the_subscriber() -> None:
    """``publish`` never waits: past ``max_queue_size`` a batch is dropped and counted,
    and the next batch sent starts with AllBlocksCleared (the subscriber starts over)."""
    from torch_topg.engine.kv_publisher import ZmqEventPublisher

    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", max_queue_size=1)
    try:
        pub._queue.put(None)  # the sending thread stops: nothing leaves the queue now
        pub._thread.join(10)
        sent = [pub.publish(KVEventBatch(float(i), [BlockRemoved([bytes([i]) * 16])])) for i in range(5)]  # fmt: skip
        assert sent == [True, False, False, False, False] and pub.dropped == 4
        batch = pub._queue.get_nowait()
        assert batch.events == [BlockRemoved([b"\x00" * 16])]
        assert pub.publish(KVEventBatch(9.0, [BlockRemoved([b"\x09" * 16])]))
        assert pub._queue.get_nowait().events == [AllBlocksCleared(), BlockRemoved([b"\x09" * 16])]
        assert pub.publish(KVEventBatch(10.0, []))  # after that, plain again
        assert pub._queue.get_nowait().events == []
    finally:
        pub._sock.close(linger=0)
        sub.close(linger=0)


def test_options_are_checked() -> None:
    model = tiny("llama-tiny")
    with pytest.raises(ParameterError, match=r"kv_events_endpoint: expected a ZMQ endpoint like 'tcp://\*:5557', got '127.0.0.1:5557'"):  # fmt: skip
        Engine.from_model(model, None, compile=False, kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ParameterError, match=r"kv_events_endpoint: cannot use 'ipc:///nonexistent/kv'"):  # fmt: skip
        Engine.from_model(model, None, compile=False, kv_events_endpoint="ipc:///nonexistent/kv")
    with pytest.raises(ParameterError, match="kv_events_topic: expected a string, got 3"):
        Engine.from_model(model, None, compile=False, kv_events_topic=3)
    from torch_topg.engine.options import from_cli_args
    from torch_topg.serve.cli import parser

    argv = ["--kv-events-endpoint", "tcp://*:5557", "--kv-events-topic", "kv"]
    assert from_cli_args(parser().parse_args(argv)) == dict(
        kv_events_endpoint="tcp://*:5557", kv_events_topic="kv"
    )
