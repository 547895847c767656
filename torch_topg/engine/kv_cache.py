"""The KV cache hierarchy: prefix reuse across requests, lower tiers, session-aware eviction.

**Prefix reuse.** A full block of committed tokens is named by a chained hash:
``h_i = blake2b(h_{i-1} || tokens of block i)``, ``h_{-1}`` a salt of what else fixes
the block's contents (model, dtype, KV dtype, block size). Blocks are hashed only when
every token in them is committed (:meth:`KVCacheManager.commit`: positions below
``seq.num_computed``, which a speculative step lowers before it commits), so a cache
entry never holds a token that may still be rolled back. A new (or preempted) sequence
takes the longest chain of hashes of its tokens that the hierarchy holds
(:meth:`~KVCacheManager.match`), always leaving at least one token to compute (the step
needs a query row to sample from). Device hits are shared copy-free (reference counts);
a hit in a lower tier is promoted: a device block is allocated and the record copied in.

**Tiers.** Device (tier 1, :class:`~torch_topg.engine.block_pool.BlockPool`), host memory
(tier 2) and a file (tier 3), see :mod:`torch_topg.engine.kv_tiers`. Tiers are exclusive:
a hash lives in one tier at a time. A cached block evicted from the device is demoted to
the host tier when there is one, else to the disk tier; a block evicted from the host
tier goes to disk; a block evicted from the last tier is dropped.

**Eviction policy** (:class:`SessionPolicy`). Without sessions: least recently released
first, and among blocks released together the deepest first (a prefix's tail is worth
less than its head, which more requests share). With ``session_id``: each block is tagged
with the session that last committed or hit it, and a session is *active* while it was
seen within ``session_ttl`` seconds. When a tier must evict, the blocks of active
sessions are kept if possible, up to ``session_share`` of the tier, the longest-active
sessions first (a session keeps its place while it stays active: under round-robin
traffic larger than the tier, recency would rotate the protection to exactly the
sessions that come back last, which is LRU's failure again); everything else (blocks of
no session, of idle sessions, of sessions past the cap) goes first, in LRU order. It is a soft priority, never a pin: when nothing else is
left, session blocks are evicted too, so a new request never waits for a session and
nothing can deadlock. ``close_session`` drops a session's priority and puts its blocks
first in line.

**Sharing and events.** With ``disk_shared`` the disk tier is a folder of block files
that every engine on the host uses (:mod:`torch_topg.engine.kv_shared_disk`): a hash
missing from this engine's index is looked up there and adopted. With ``kv_events``
every hash entering or leaving a tier is recorded in vLLM's event format
(:mod:`torch_topg.engine.kv_events`, :attr:`KVCacheManager.events`), for routers.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch

from torch_topg.engine.block_pool import BlockPool
from torch_topg.engine.kv_events import KVEventLog, mediums
from torch_topg.engine.kv_shared_disk import SharedDiskStore
from torch_topg.engine.kv_tiers import DiskStore, HostStore, TierIndex, block_nbytes

Store = HostStore | DiskStore | SharedDiskStore

if TYPE_CHECKING:
    from torch_topg.engine.sequence import Sequence


def chain_hash(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The hash of a block: its parent's hash and its tokens (int64, little endian)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class SessionPolicy:
    """Which cached blocks a tier evicts first (see the module docstring)."""

    def __init__(
        self, ttl: float, share: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self.share = share
        self.clock = clock
        self.last_seen: dict[str, float] = {}
        self.since: dict[str, float] = {}  # when each active session became active

    def touch(self, session: str | None) -> None:
        if session is not None:
            self.active()  # an expired session starts over
            now = self.clock()
            self.last_seen[session] = now
            self.since.setdefault(session, now)

    def close(self, session: str) -> None:
        self.last_seen.pop(session, None)
        self.since.pop(session, None)

    def active(self) -> dict[str, float]:
        """Active sessions and when each became active (expired ones are dropped)."""
        now = self.clock()
        for s in [s for s, t in self.last_seen.items() if now - t >= self.ttl]:
            self.close(s)  # idle past the TTL: its blocks are ordinary LRU now
        return self.since

    def pick(
        self, order: OrderedDict[int, None], count: int, session_of: list[str | None], size: int
    ) -> list[int]:
        """``count`` ids of ``order`` (oldest first) to evict in a tier of ``size`` blocks."""
        active = self.active() if self.last_seen else {}
        if not active:
            it = iter(order)
            return [next(it) for _ in range(count)]
        held = Counter(session_of[b] for b in order if session_of[b] in active)
        room = int(self.share * size)
        keep: set[str] = set()
        for s in sorted(held, key=active.__getitem__):
            if held[s] <= room:
                keep.add(s)
                room -= held[s]
        out = [b for b in order if session_of[b] not in keep][:count]
        if len(out) < count:
            out += [b for b in order if session_of[b] in keep][: count - len(out)]
        return out


class KVCacheManager:
    """Prefix index, tiers and eviction for one engine's paged pool."""

    def __init__(
        self,
        pool: BlockPool,
        *,
        enabled: bool = True,
        salt: bytes = b"",
        host_blocks: int = 0,
        disk_folder: str | None = None,
        disk_blocks: int = 0,
        disk_shared: bool = False,
        disk_cap: int = 0,
        kv_events: bool = False,
        session_ttl: float = 600.0,
        session_share: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pool = pool
        self.enabled = enabled
        self.root = hashlib.blake2b(salt, digest_size=16).digest()
        self.policy = SessionPolicy(session_ttl, session_share, clock)
        self.dev_session: list[str | None] = [None] * pool.num_blocks
        self.host: TierIndex | None = TierIndex("host", host_blocks) if host_blocks else None
        self.disk: TierIndex | None = TierIndex("disk", disk_blocks) if disk_blocks else None
        self._disk_folder = disk_folder
        self._disk_shared = disk_shared
        self._disk_cap = disk_cap
        self.events: KVEventLog | None = KVEventLog(pool.block_size) if kv_events else None
        self._medium = "CPU"
        self.stores: dict[str, Store] = {}
        self.caches: list[torch.Tensor] = []
        self.counts: dict[str, Counter[str]] = {t: Counter() for t in ("device", "host", "disk")}
        self.prefix: Counter[str] = Counter(queries=0, query_tokens=0, hit_tokens=0)
        self.sessions: dict[str, Counter[str]] = {}
        self._loader: ThreadPoolExecutor | None = None
        self._loads: list[Future[list[bool]]] = []
        pool.pick = lambda cached, n: self.policy.pick(cached, n, self.dev_session, pool.num_blocks)
        pool.on_evict = self._on_device_evict

    # --- set-up ------------------------------------------------------------------------
    def bind(self, caches: list[torch.Tensor]) -> None:
        """The runner's cache tensors (every per-block tensor, block dimension 0); the
        lower tiers are allocated here, in their layout."""
        self.caches = caches
        names = mediums(caches[0].device.type if caches else "cpu")
        self._medium = names["device"]
        for t in self.tiers():
            t.log, t.medium = self.events, names[t.name]
        if self.host is not None:
            self.stores["host"] = HostStore(caches, self.host.num_slots)
        if self.disk is not None:
            assert self._disk_folder is not None
            if self._disk_shared:  # the cache's identity (the hashes' root) names its files
                cap = self._disk_cap or self.disk.num_slots * block_nbytes(caches)
                self.stores["disk"] = SharedDiskStore(caches, self._disk_folder, cap, self.root)
            else:
                self.stores["disk"] = DiskStore(caches, self.disk.num_slots, self._disk_folder)

    def close(self) -> None:
        if self._loader is not None:
            self._loader.shutdown(wait=True)
        for store in self.stores.values():
            store.close()

    def tiers(self) -> list[TierIndex]:
        return [t for t in (self.host, self.disk) if t is not None]

    # --- hashing -----------------------------------------------------------------------
    def block_hashes(self, seq: Sequence, count: int) -> list[bytes]:
        """Hashes of ``seq``'s first ``count`` full blocks (memoised on the sequence)."""
        hs = seq.block_hashes
        bs = self.pool.block_size
        toks = seq.token_ids
        while len(hs) < count:
            i = len(hs)
            hs.append(chain_hash(hs[-1] if hs else self.root, toks[i * bs : (i + 1) * bs]))
        return hs[:count]

    # --- the scheduler's calls ---------------------------------------------------------
    def match(self, seq: Sequence) -> int:
        """Give a sequence with no blocks the longest cached prefix of its tokens; returns
        the tokens it can reuse now.

        Device hits are shared at once. Lower-tier hits get fresh device blocks and their
        records are copied in by a background thread (:meth:`load_done` tells when the
        sequence can run): the copy overlaps the steps of the running sequences.
        """
        assert not seq.blocks and seq.num_computed == 0 and seq.kv_load is None
        if not self.enabled:
            return 0
        bs = self.pool.block_size
        hashes = self.block_hashes(seq, (seq.num_tokens - 1) // bs)
        blocks: list[int] = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        self.pool.share(blocks)
        self.counts["device"]["hits"] += len(blocks)
        sid = seq.session_id
        for b in blocks:
            self.dev_session[b] = sid
        self.policy.touch(sid)
        seq.blocks = blocks
        seq.num_computed = len(blocks) * bs
        self.prefix["queries"] += 1
        self.prefix["query_tokens"] += seq.num_tokens
        self.prefix["lookup_blocks"] += len(hashes)
        if sid is not None:
            c = self.sessions.setdefault(sid, Counter())
            c["requests"] += 1
            c["query_tokens"] += seq.num_tokens
        self._start_load(seq, hashes[len(blocks) :])
        if seq.kv_load is None:
            self._count_hit(seq)
        return seq.num_computed

    def load_done(self, seq: Sequence, wait: bool = False) -> bool:
        """Whether ``seq``'s lower-tier copy (if any) has finished; when it has, the
        promoted blocks join ``seq.blocks`` (up to the first unreadable record)."""
        load = seq.kv_load
        if load is None:
            return True
        future, found, new = load
        if not wait and not future.done():
            return False
        oks: list[bool] = future.result()
        seq.kv_load = None
        bs = self.pool.block_size
        kept = 0  # the copy stops at the first unreadable record: oks is True* False*
        for (tier, slot, h), b, ok in zip(found, new, oks, strict=True):
            c = self.counts[tier.name]
            if not ok:
                if b == new[kept]:  # the unreadable one: dropped
                    c["errors"] += 1
                    tier.release(slot)
                else:  # not read: stays in its tier
                    tier.unpin(slot)
                continue
            tier.release(slot)  # promoted: the tiers are exclusive
            if self.pool.register(b, h):  # False: the device computed it meanwhile (fine)
                self._drop_lower(h)  # a stale copy demoted while this one was pinned
                self._stored(seq, [h])
            self.dev_session[b] = seq.session_id
            kept += 1
            c["hits"] += 1
            c["promoted"] += 1
            c["bytes_read"] += self.stores[tier.name].block_bytes
        seq.blocks.extend(new[:kept])
        self.pool.free(new[kept:][::-1])  # past a failed read: back to the free list
        seq.num_computed = len(seq.blocks) * bs
        self._count_hit(seq)
        return True

    def wait_for_loads(self, timeout: float) -> None:
        """Block until the oldest copy in flight ends (or ``timeout`` s): the engine's loop
        calls it when nothing else can run, instead of spinning."""
        if self._loads:
            futures = [f for f in self._loads if not f.done()]
            if futures:
                wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)
            self._loads = [f for f in self._loads if not f.done()]

    def _count_hit(self, seq: Sequence) -> None:
        n = seq.num_computed
        self.prefix["hit_tokens"] += n
        if seq.session_id is not None and seq.session_id in self.sessions:
            self.sessions[seq.session_id]["hit_tokens"] += n

    def commit(self, seq: Sequence) -> None:
        """Hash ``seq``'s full blocks of committed tokens (those below ``num_computed``)."""
        if not self.enabled or not seq.blocks:
            return
        bs = self.pool.block_size
        full = min(seq.num_computed, seq.num_tokens) // bs
        hashes = self.block_hashes(seq, full)
        sid = seq.session_id
        new: list[bytes] = []
        for i in range(seq.num_committed_blocks, full):
            b = seq.blocks[i]
            if self.pool.hash_of(b) is None and self.pool.register(b, hashes[i]):
                self._drop_lower(hashes[i])  # tiers stay exclusive
                new.append(hashes[i])
            self.dev_session[b] = sid
        if new:
            self._stored(seq, new)
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)
        self.policy.touch(sid)

    def _stored(self, seq: Sequence, hashes: list[bytes]) -> None:
        """Record device blocks of ``seq`` just named by their hashes (KV events): each
        run of consecutive blocks as one ``BlockStored`` with its parent and tokens."""
        if self.events is None:
            return
        bs = self.pool.block_size
        index = {h: i for i, h in enumerate(seq.block_hashes)}
        runs: list[list[int]] = []
        for i in sorted(index[h] for h in hashes):
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = seq.block_hashes[first - 1] if first else None
            toks = seq.token_ids[first * bs : (last + 1) * bs]
            self.events.stored([seq.block_hashes[i] for i in run], parent, toks, self._medium)

    def release(self, seq: Sequence) -> None:
        """Commit, then drop ``seq``'s hold on its blocks, deepest first (and on its parked
        KV, if any)."""
        if seq.parked is not None:
            assert self.host is not None
            for slot in seq.parked[0]:
                self.host.release(slot)
            seq.parked = None
        self.load_done(seq, wait=True)  # a copy in flight writes into its blocks
        self.commit(seq)
        self.pool.free(seq.blocks[::-1])
        seq.blocks = []
        seq.num_committed_blocks = 0

    # --- parking (priority preemption) --------------------------------------------------
    def park(self, seq: Sequence) -> bool:
        """Preemption without recompute: copy the blocks holding ``seq``'s computed tokens
        to host slots (evicting cached blocks of the host tier for room), then release its
        device blocks. False (nothing done) without a host tier or room in it."""
        host, n = self.host, seq.num_computed
        count = self.pool.blocks_for(n)
        if host is None or count == 0 or seq.kv_load is not None:
            return False
        while len(host._free) < count and host.lru:
            (victim,) = self.policy.pick(host.lru, 1, host.session, host.num_slots)
            self._evict_slot(host, victim)
        if len(host._free) < count:
            return False
        store = self.stores["host"]
        slots = [host.take_free() for _ in range(count)]
        for slot, b in zip(slots, seq.blocks[:count], strict=True):
            store.write(self.caches, b, slot)
        host.parked.update(slots)
        self.release(seq)
        seq.parked = (slots, n)
        c = self.counts["host"]
        c["parked"] += count
        c["bytes_written"] += count * store.block_bytes
        return True

    def unpark(self, seq: Sequence, budget: int) -> bool:
        """Bring a parked sequence's KV back into fresh device blocks, when the pool has
        room for them and for its next ``budget`` tokens (so its admission cannot fail
        and drop them again); False: not yet."""
        assert seq.parked is not None and self.host is not None and not seq.blocks
        slots, n = seq.parked
        need = self.pool.blocks_for(n + min(seq.num_tokens - n, budget))
        if need > self.pool.num_free:
            return False
        blocks = self.pool.allocate(len(slots))
        store = self.stores["host"]
        for slot, b in zip(slots, blocks, strict=True):
            store.read(slot, self.caches, b)
            self.host.release(slot)
        seq.parked = None
        seq.blocks = blocks
        seq.num_computed = n
        c = self.counts["host"]
        c["unparked"] += len(slots)
        c["bytes_read"] += len(slots) * store.block_bytes
        return True

    def close_session(self, session: str) -> None:
        """No more priority for ``session``; its cached blocks go first in line."""
        self.policy.close(session)
        self.sessions.pop(session, None)
        self.pool.evict_first(
            [b for b in self.pool.cached_blocks() if self.dev_session[b] == session]
        )
        for t in self.tiers():
            for s in [s for s in t.lru if t.session[s] == session]:
                t.lru.move_to_end(s, last=False)

    # --- moving blocks between tiers ---------------------------------------------------
    def _start_load(self, seq: Sequence, hashes: list[bytes]) -> None:
        """Device blocks for the leading ``hashes`` found in lower tiers, filled by the
        loader thread; sets ``seq.kv_load`` (None when there is nothing to load)."""
        found: list[tuple[TierIndex, int, bytes]] = []
        for h in hashes:
            hit = None
            for t in self.tiers():
                slot = t.lookup(h)
                if slot is None and t is self.disk and self._disk_shared:
                    slot = self._adopt(h)  # written by another engine of the host
                if slot is not None and slot not in t.pinned:  # pinned: another load's
                    hit = (t, slot)
                    break
            if hit is None:
                break
            hit[0].pin(hit[1])  # not evicted by the demotions the allocation below causes
            found.append((hit[0], hit[1], h))
        n = min(len(found), self.pool.num_free)
        for t, slot, _ in found[n:]:  # no device room for these: they stay where they are
            t.unpin(slot)
        found = found[:n]
        if not found:
            return
        new = self.pool.allocate(n)
        jobs = [
            (self.stores[t.name], slot, b, h) for (t, slot, h), b in zip(found, new, strict=True)
        ]
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="topg-kv-load")
        future = self._loader.submit(self._copy_in, jobs)
        self._loads.append(future)
        seq.kv_load = (future, found, new)

    def _adopt(self, h: bytes) -> int | None:
        """A slot of the shared disk tier's index for a block another engine wrote (its
        file exists); None when it does not or every slot is pinned. The index's oldest
        entry makes room (forgotten here; its file stays for whoever wants it)."""
        tier, store = self.disk, self.stores["disk"]
        assert tier is not None and isinstance(store, SharedDiskStore)
        if not store.has(h):
            return None
        if not tier.has_free():
            if not tier.lru:
                return None
            self._evict_slot(tier, next(iter(tier.lru)))
        slot = tier.take_free()
        tier.fill(slot, h, None)
        self.counts["disk"]["adopted"] += 1
        return slot

    def _copy_in(self, jobs: list[tuple[Store, int, int, bytes]]) -> list[bool]:
        """The loader thread: records into device blocks, in chain order; stops at the
        first unreadable one (the rest of the chain is recomputed anyway)."""
        stream = None
        if self.caches and self.caches[0].device.type == "cuda":
            stream = torch.cuda.Stream(self.caches[0].device)
        oks: list[bool] = []
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for store, slot, block, h in jobs:
                ok = bool(oks[-1]) if oks else True
                oks.append(ok and store.read(slot, self.caches, block, h))
        if stream is not None:
            stream.synchronize()
        return oks

    def _on_device_evict(self, block: int, h: bytes) -> None:
        self.counts["device"]["evicted"] += 1
        if self.events is not None:
            self.events.removed([h], self._medium)
        sid = self.dev_session[block]
        self.dev_session[block] = None
        tiers = self.tiers()
        if tiers:
            self._store(tiers[0], self.caches, block, h, sid)

    def _store(
        self, tier: TierIndex, src: list[torch.Tensor], index: int, h: bytes, sid: str | None
    ) -> None:
        """Demote a block (rows ``index`` of ``src``) into ``tier``, evicting its oldest."""
        if tier.lookup(h) is not None:
            return  # a copy is there already (a load in flight pins it): keep one
        if not tier.has_free():
            if not tier.lru:  # every slot pinned by a promotion in flight
                self.counts[tier.name]["dropped"] += 1
                return
            (victim,) = self.policy.pick(tier.lru, 1, tier.session, tier.num_slots)
            self._evict_slot(tier, victim)
        slot = tier.take_free()
        store = self.stores[tier.name]
        store.write(src, index, slot, h)
        tier.fill(slot, h, sid)
        c = self.counts[tier.name]
        c["stored"] += 1
        c["bytes_written"] += store.block_bytes

    def _evict_slot(self, tier: TierIndex, slot: int) -> None:
        """Free ``slot`` of ``tier``, demoting its block to the next tier down if any."""
        self.counts[tier.name]["evicted"] += 1
        h, sid = tier.hash_of[slot], tier.session[slot]
        if tier is self.host and self.disk is not None and h is not None:
            src = self.stores["host"]
            assert isinstance(src, HostStore)
            self._store(self.disk, src.tensors, slot, h, sid)
        tier.release(slot)

    def _drop_lower(self, h: bytes) -> None:
        for t in self.tiers():
            s = t.lookup(h)
            if s is not None and s not in t.pinned:
                t.release(s)

    # --- introspection -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        p = self.prefix
        active = self.policy.active()
        for sid in [s for s in self.sessions if s not in active]:
            del self.sessions[sid]  # idle past the TTL: its figures go with its priority
        tiers: dict[str, Any] = {
            "device": {
                "blocks_total": self.pool.num_blocks,
                "blocks_used": self.pool.num_used,
                "blocks_cached": self.pool.num_cached,
                **self.counts["device"],
            }
        }
        for t in self.tiers():
            tiers[t.name] = {
                "blocks_total": t.num_slots,
                "blocks_used": t.num_used,
                "bytes": self.stores[t.name].nbytes if t.name in self.stores else 0,
                **self.counts[t.name],
            }
            store = self.stores.get(t.name)
            if isinstance(store, SharedDiskStore):
                tiers[t.name].update(shared=True, files_evicted=store.evicted,
                                     folder_scans=store.scans)  # fmt: skip
        return {
            "prefix_caching": self.enabled,
            "queries": p["queries"],
            "query_tokens": p["query_tokens"],
            "hit_tokens": p["hit_tokens"],
            "hit_rate": p["hit_tokens"] / p["query_tokens"] if p["query_tokens"] else 0.0,
            "tiers": tiers,
            "sessions": {s: dict(c) for s, c in self.sessions.items()},
            "active_sessions": len(active),
        }

    def check(self) -> None:
        """Every tier's bookkeeping is consistent (tests)."""
        self.pool.check_consistent()
        for t in self.tiers():
            t.check()
            if t.pinned:
                raise AssertionError(f"{t.name} tier: slots left pinned: {sorted(t.pinned)}")
            if t.parked:
                raise AssertionError(f"{t.name} tier: slots left parked: {sorted(t.parked)}")
