"""The disk KV tier shared by the engines of one host (``disk_kv_shared=True``) and the
KV events (vLLM's format) the router reads: two engines on one folder, the second finds
the first's prefix and answers as an engine that computed it; the folder's cap evicts
least recently used files; writes are atomic; the events name exactly what each tier
holds, and the router hashes a prompt as the engine does."""

from __future__ import annotations

import os

import pytest
import torch
from engine_utils import prompts, tiny, wait_idle

from torch_topg.engine import Engine
from torch_topg.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    from_wire,
    to_wire,
)
from torch_topg.engine.kv_shared_disk import HEADER_BYTES, SharedDiskStore

GREEDY = {"temperature": 0, "ignore_eos": True}
BLOCK = 4
BLOCK_BYTES = 2 * 2 * 4 * 2 * 32 * 4  # llama-tiny: K+V x 2 layers x 4 rows x 2 heads x 32 x fp32


def _engine(folder: str, cap: int = 1 << 20, seed: int = 0, **kw) -> Engine:
    model = tiny("llama-tiny", seed=seed)
    return Engine.from_model(
        model, None, block_size=BLOCK, compile=False, seed=0, kv_cache_memory=16 * BLOCK_BYTES,
        disk_kv_path=folder, disk_kv_memory=cap, disk_kv_shared=True, **kw,
    )  # fmt: skip


def _flush(eng: Engine, n: int = 3) -> None:
    """Push the device's cached blocks down to disk: unrelated prompts that need the pool."""
    for p in prompts(99, [14 * BLOCK] * n, vocab=200):
        eng.generate(p, max_new_tokens=1, **GREEDY)
    wait_idle(eng)


def _kv_files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".kv"))


def test_second_engine_reads_the_first_ones_prefix(tmp_path) -> None:
    (prompt,) = prompts(0, [10 * BLOCK + 1], vocab=200)
    with _engine(str(tmp_path)) as a, _engine(str(tmp_path)) as b:
        want = a.generate(prompt, max_new_tokens=6, **GREEDY)[0]
        _flush(a)
        files = _kv_files(tmp_path)
        assert len(files) >= 10, files  # the prompt's 10 full blocks at least
        fp = a.kv.stores["disk"].fingerprint[:8].hex()
        assert all(f.endswith(f"-{fp}.kv") and len(f.split("-")[0]) == 32 for f in files)
        got = b.generate(prompt, max_new_tokens=6, **GREEDY)[0]
        assert got.cached_prompt_tokens == 10 * BLOCK  # the whole prefix, from a's files
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        st = b.stats()["kv"]["tiers"]["disk"]
        assert st["adopted"] == 10 and st["promoted"] == 10 and st["shared"]
        wait_idle(b)
        b.kv.check()


def test_a_different_model_does_not_read_the_files(tmp_path) -> None:
    (prompt,) = prompts(1, [6 * BLOCK + 1], vocab=200)
    with _engine(str(tmp_path)) as a, _engine(str(tmp_path), seed=1) as other:
        a.generate(prompt, max_new_tokens=2, **GREEDY)
        _flush(a)
        assert other.kv.stores["disk"].fingerprint != a.kv.stores["disk"].fingerprint
        out = other.generate(prompt, max_new_tokens=2, **GREEDY)[0]
        assert out.cached_prompt_tokens == 0


def test_cap_evicts_least_recently_used_files(tmp_path) -> None:
    caches = [torch.randn(8, 4, 2, 8) for _ in range(2)]
    per_file = HEADER_BYTES + 2 * 4 * 2 * 8 * 4
    store = SharedDiskStore(caches, str(tmp_path), cap_bytes=10 * per_file, fingerprint=b"f" * 16)
    keys = [bytes([i]) * 16 for i in range(10)]
    for i, k in enumerate(keys):
        store.write(caches, i % 8, 0, k)
        os.utime(store.path(k), (1000 + i, 1000 + i))  # a clear age order
    assert store.evicted == 0 and len(_kv_files(tmp_path)) == 10
    out = [torch.empty_like(t) for t in caches]
    assert store.read(0, out, 0, keys[0])  # read: the oldest becomes the newest
    store.write(caches, 0, 0, b"\xff" * 16)  # over the cap: down to 90%
    left = {bytes.fromhex(f.split("-")[0]) for f in _kv_files(tmp_path)}
    assert len(left) == 9 and store.evicted == 2
    assert keys[0] in left and keys[1] not in left and keys[2] not in left
    # a second engine's store on the folder evicts what it finds over the cap, too
    other = SharedDiskStore(caches, str(tmp_path), cap_bytes=5 * per_file, fingerprint=b"g" * 16)
    other.write(caches, 1, 0, b"\xee" * 16)
    assert len(_kv_files(tmp_path)) <= 4


def test_writes_are_atomic_and_checked(tmp_path, monkeypatch) -> None:
    caches = [torch.randn(4, 4, 2, 8)]
    store = SharedDiskStore(caches, str(tmp_path), cap_bytes=1 << 20, fingerprint=b"f" * 16)
    key = b"k" * 16
    seen: list[list[str]] = []
    real_replace = os.replace

    def replace(src, dst):  # what a reader could see just before the rename
        seen.append(sorted(os.listdir(tmp_path)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    store.write(caches, 2, 0, key)
    assert seen and not any(n.endswith(".kv") for n in seen[0])  # only the temporary file
    assert [n for n in os.listdir(tmp_path)] == [os.path.basename(store.path(key))]
    out = [torch.zeros_like(caches[0])]
    assert store.read(0, out, 1, key) and torch.equal(out[0][1], caches[0][2])
    # a torn file (a crash mid-copy by some other writer) is a miss, and deleted
    data = open(store.path(key), "rb").read()
    with open(store.path(key), "wb") as f:
        f.write(data[:-7])
    assert not store.read(0, out, 1, key) and not os.path.exists(store.path(key))
    # a flipped byte fails the CRC
    store.write(caches, 2, 0, key)
    raw = bytearray(open(store.path(key), "rb").read())
    raw[-1] ^= 0xFF
    open(store.path(key), "wb").write(bytes(raw))
    assert not store.read(0, out, 1, key) and store.errors == 2


def test_kv_events_match_the_tiers(tmp_path) -> None:
    """Replaying the events gives exactly the hashes each tier holds."""
    with _engine(str(tmp_path), kv_events=True) as eng:
        for p in prompts(2, [9 * BLOCK + 1, 5 * BLOCK, 14 * BLOCK, 9 * BLOCK + 1], vocab=200):
            eng.generate(p, max_new_tokens=3, **GREEDY)
        wait_idle(eng)
        cursor, batch = eng.kv.events.since(0)
        assert cursor == eng.kv.events.cursor and batch.events
        held: dict[str, set[bytes]] = {}
        for e in from_wire(to_wire(batch)).events:
            if isinstance(e, BlockStored):
                assert e.block_size == BLOCK
                if e.token_ids:  # the device's own blocks: the chain is checkable
                    assert len(e.token_ids) == BLOCK * len(e.block_hashes)
                held.setdefault(e.medium, set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held[e.medium] -= set(e.block_hashes)
        pool = eng.pool
        device = {pool.hash_of(b) for b in range(pool.num_blocks)} - {None}
        assert held["CPU"] == device
        disk = eng.kv.disk
        assert held["DISK"] == set(disk.by_hash) and held["DISK"]
        # the chain: a stored run's first hash is chain_hash(parent, its tokens)
        from torch_topg.engine.kv_cache import chain_hash

        e = next(e for e in batch.events if isinstance(e, BlockStored) and e.token_ids)
        parent = e.parent_block_hash or eng.kv.root
        assert e.block_hashes[0] == chain_hash(parent, e.token_ids[:BLOCK])


def test_event_log_wire_format_and_overflow() -> None:
    log = KVEventLog(block_size=16, capacity=3)
    log.stored([b"a" * 16, b"b" * 16], None, list(range(32)), "GPU")
    wire = to_wire(log.since(0)[1])
    # vLLM 0.33's layout: the batch array-like, each event a map tagged by "type"
    # (test_cluster_kv_publisher.py holds it against vLLM's own bytes)
    assert wire[1] == [
        {"type": "BlockStored", "block_hashes": [b"a" * 16, b"b" * 16],
         "parent_block_hash": None, "token_ids": list(range(32)), "block_size": 16,
         "lora_id": None, "medium": "GPU", "lora_name": None}
    ]  # fmt: skip
    assert len(wire) == 2  # data_parallel_rank omitted while None
    log.removed([b"a" * 16], "GPU")
    log.cleared()
    log.removed([b"c" * 16], "DISK")  # the first event falls out of the log
    cur, batch = log.since(1)
    assert cur == 4 and [type(e) for e in batch.events] == [
        BlockRemoved,
        AllBlocksCleared,
        BlockRemoved,
    ]
    _, late = log.since(0)  # behind the log: told to start over
    assert isinstance(late.events[0], AllBlocksCleared) and len(late.events) == 4
    assert from_wire(to_wire(KVEventBatch(1.5, [], 3))).data_parallel_rank == 3
    with pytest.raises(ValueError, match="unknown or malformed"):
        from_wire([0.0, [["Nope"]]])


def test_prompt_hashes_equal_the_engines() -> None:
    """The router hashes a prompt as the engine does: its KV events name the same blocks."""
    from torch_topg.cluster.router import block_hashes

    model = tiny("llama-tiny")
    with Engine.from_model(model, None, block_size=4, compile=False, kv_events=True) as eng:
        (p,) = prompts(3, [4 * 5], vocab=200)
        eng.generate(p, max_new_tokens=1, temperature=0)
        wait_idle(eng)
        _, batch = eng.kv.events.since(0)
        announced = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    mine = block_hashes(eng.kv.root, p, 4)
    assert len(mine) == 4 and announced[: len(mine)] == mine
