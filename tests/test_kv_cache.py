"""The KV cache hierarchy's bookkeeping: a stateful hypothesis test of the device pool,
the prefix index, the host and disk tiers and the session policy, on stand-in cache
tensors whose block contents are a function of the block's prefix hash (so every
demote / promote round trip is checked bitwise)."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from torch_topg.engine.block_pool import BlockPool, OutOfBlocks
from torch_topg.engine.kv_cache import KVCacheManager, SessionPolicy, chain_hash
from torch_topg.engine.kv_tiers import TierIndex

BS = 2  # tokens per block


class FakeRequest:
    def __init__(self, tokens, session):
        self.prompt_token_ids = tokens
        self.session_id = session


class FakeSeq:
    """What the manager reads of a :class:`~torch_topg.engine.sequence.Sequence`."""

    def __init__(self, tokens: list[int], session: str | None) -> None:
        self.token_ids = list(tokens)
        self.session_id = session
        self.blocks: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_committed_blocks = 0
        self.num_computed = 0
        self.kv_load = None
        self.parked = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def content(h: bytes, shape) -> torch.Tensor:
    """The stand-in KV of the block whose prefix hash is ``h``."""
    g = torch.Generator().manual_seed(int.from_bytes(h[:8], "little") & (2**62 - 1))
    return torch.randn(shape, generator=g)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Hierarchy(RuleBasedStateMachine):
    """Sequences start (taking their cached prefix), compute, commit, get preempted or
    aborted, and finish, over a pool of 6 device blocks, 4 host slots, 5 disk slots."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.clock = Clock()
        self.pool = BlockPool(6, BS)
        self.kv = KVCacheManager(
            self.pool, host_blocks=4, disk_folder=self.dir.name, disk_blocks=5,
            session_ttl=10.0, session_share=0.5, clock=self.clock,
        )  # fmt: skip
        # two "layers" of K and V, 3 heads x 4 dims, float32 and bfloat16
        self.caches = [
            torch.zeros(6, BS, 3, 4, dtype=torch.float32 if i % 2 else torch.bfloat16)
            for i in range(4)
        ]
        self.kv.bind(self.caches)
        self.seqs: list[FakeSeq] = []
        self.loading: list[FakeSeq] = []

    def teardown(self) -> None:
        self.kv.close()
        self.dir.cleanup()

    def _write(self, seq: FakeSeq, start: int, end: int) -> None:
        """'Compute' tokens [start, end): full blocks get their hash's content."""
        hashes = self.kv.block_hashes(seq, end // BS)
        for i in range(start // BS, -(-end // BS)):
            b = seq.blocks[i]
            for t in self.caches:
                if (i + 1) * BS <= end:
                    t[b] = content(hashes[i], t[b].shape).to(t.dtype)
                else:
                    t[b] = float("nan")  # a partial block: never hashed

    @rule(
        tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9),
        session=st.sampled_from([None, "a", "b"]),
        now=st.booleans(),
    )
    def start(self, tokens, session, now):
        if len(self.seqs) + len(self.loading) >= 3:
            return
        seq = FakeSeq(tokens, session)
        self.kv.match(seq)
        if seq.kv_load is not None and not now:
            self.loading.append(seq)  # the copy stays in flight across other rules
            return
        self._admit(seq)

    @precondition(lambda self: self.loading)
    @rule(data=st.data(), admit=st.booleans())
    def end_load(self, data, admit):
        seq = data.draw(st.sampled_from(self.loading))
        self.loading.remove(seq)
        if admit:
            self._admit(seq)
        else:  # aborted while loading: release waits for the copy
            self.kv.release(seq)

    def _admit(self, seq: FakeSeq) -> None:
        assert self.kv.load_done(seq, wait=True) and seq.kv_load is None
        hit = seq.num_computed
        tokens = seq.token_ids
        assert hit % BS == 0 and hit <= len(tokens) - 1
        for i, b in enumerate(seq.blocks):  # a hit has the content of its hash
            h = self.kv.block_hashes(seq, i + 1)[i]
            assert self.pool.hash_of(b) in (h, None)  # None: computed meanwhile elsewhere
            for t in self.caches:
                assert torch.equal(t[b], content(h, t[b].shape).to(t.dtype))
        need = self.pool.blocks_for(len(tokens)) - len(seq.blocks)
        try:
            seq.blocks += self.pool.allocate(need)
        except OutOfBlocks:
            self.kv.release(seq)
            return
        self._write(seq, seq.num_computed, len(tokens))
        seq.num_computed = len(tokens)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tok=st.integers(0, 1))
    def decode(self, data, tok):
        seq = data.draw(st.sampled_from(self.seqs))
        seq.token_ids.append(tok)
        if self.pool.blocks_for(seq.num_tokens) > len(seq.blocks):
            try:
                seq.blocks += self.pool.allocate(1)
            except OutOfBlocks:  # preempted: released, as the scheduler does
                seq.token_ids.pop()
                self._finish(seq)
                return
        self._write(seq, seq.num_computed, seq.num_tokens)
        seq.num_computed = seq.num_tokens
        self.kv.commit(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish(self, data):
        self._finish(data.draw(st.sampled_from(self.seqs)))

    def _finish(self, seq: FakeSeq) -> None:
        self.kv.release(seq)
        self.seqs.remove(seq)

    @rule(dt=st.sampled_from([1.0, 20.0]))
    def time_passes(self, dt):
        self.clock.now += dt

    @rule(session=st.sampled_from(["a", "b"]))
    def close_session(self, session):
        self.kv.close_session(session)

    @rule(index=st.integers(0, 4))
    def corrupt_disk_record(self, index):
        store = self.kv.stores["disk"]
        os.pwrite(store.fd, b"\xff" * 8, index * store.block_bytes)

    @invariant()
    def whole_and_bitwise(self):
        if not self.loading:
            self.kv.check()
        else:
            self.pool.check_consistent()
        held = sum(len(s.blocks) for s in self.seqs + self.loading)
        held += sum(len(s.kv_load[2]) for s in self.loading if s.kv_load is not None)
        assert self.pool.num_used <= held  # shared blocks count once
        for b in range(self.pool.num_blocks):
            h = self.pool.hash_of(b)
            if h is not None:
                for t in self.caches:
                    assert torch.equal(t[b], content(h, t[b].shape).to(t.dtype))
        host = self.kv.stores["host"]
        for s in self.kv.host.lru:
            h = self.kv.host.hash_of[s]
            for t in host.tensors:
                assert torch.equal(t[s], content(h, t[s].shape).to(t.dtype))
        assert self.kv.host.num_used <= 4 and self.kv.disk.num_used <= 5


TestHierarchy = Hierarchy.TestCase
TestHierarchy.settings = settings(
    max_examples=60, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip


def test_disk_round_trip_is_checked():
    """A record reads back bitwise; a corrupted one is refused (a miss, never bad KV)."""
    with tempfile.TemporaryDirectory() as d:
        pool = BlockPool(2, BS)
        kv = KVCacheManager(pool, disk_folder=d, disk_blocks=2)
        caches = [torch.randn(2, BS, 3, 4), torch.randn(2, BS, 3, 4).bfloat16()]
        kv.bind(caches)
        disk = kv.stores["disk"]
        disk.write(caches, 0, 1)
        out = [torch.zeros_like(t) for t in caches]
        assert disk.read(1, out, 1)
        assert all(torch.equal(o[1], t[0]) for o, t in zip(out, caches, strict=True))
        os.pwrite(disk.fd, b"\x00\x01", disk.block_bytes + 5)
        assert not disk.read(1, out, 0) and disk.errors == 1
        assert not disk.read(0, out, 0)  # never written
        kv.close()
        assert not os.path.exists(disk.path)


def test_chain_hash_depends_on_the_whole_prefix():
    a = chain_hash(b"r", [1, 2])
    assert chain_hash(a, [3, 4]) != chain_hash(chain_hash(b"r", [1, 3]), [3, 4])
    assert chain_hash(b"r", [1, 2]) == a and chain_hash(b"s", [1, 2]) != a


def test_session_policy_keeps_active_sessions_within_the_share():
    clock = Clock()
    pol = SessionPolicy(ttl=5.0, share=0.5, clock=clock)
    tier = TierIndex("t", 8)
    tags = ["a", "a", None, "b", "b", "b", None, "a"]
    for s, tag in enumerate(tags):
        tier.fill(tier.take_free(), bytes([s]), tag)
    pol.touch("a")
    clock.now = 1.0
    pol.touch("b")
    pol.touch("a")  # a (3 blocks) active longest, then b (3): only a fits in half of 8
    order = tier.lru
    assert pol.pick(order, 3, tier.session, 8) == [2, 3, 4]
    assert pol.pick(order, 7, tier.session, 8) == [2, 3, 4, 5, 6, 0, 1]  # a last
    clock.now = 10.0  # both idle past the TTL: plain LRU
    assert pol.pick(order, 2, tier.session, 8) == [0, 1]


def test_pool_eviction_order_and_errors():
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    for b, h in zip(a, [b"x", b"y", b"z"], strict=True):
        assert pool.register(b, h)
    assert not pool.register(a[0], b"w")  # already named
    pool.free(a[::-1])  # deepest first
    assert pool.cached_blocks() == [a[2], a[1], a[0]] and pool.num_free == 4
    evicted = []
    pool.on_evict = lambda b, h: evicted.append(h)
    pool.allocate(2)  # the free block, then the deepest cached one
    assert evicted == [b"z"] and pool.lookup(b"z") is None and pool.lookup(b"x") == a[0]
    pool.share([a[0]])
    assert pool.ref_count(a[0]) == 1
    with pytest.raises(RuntimeError, match="already free"):
        pool.free([a[1]])
        pool.free([a[1]])
