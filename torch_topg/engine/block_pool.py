"""The device KV pool's bookkeeping: free blocks, held blocks, and cached blocks.

The pool's memory (one K and one V tensor per layer, ``[num_blocks, block_size, Hkv,
D]``) is allocated once by the model runner; this class only hands out block ids. A
block has a reference count, so blocks are shared copy-free (``n`` samples of one prompt
share its full blocks; the prefix cache shares them between requests).

A block whose count drops to zero goes to one of two places:

- the **free list** if it holds nothing reusable (never hashed); a stack: the most
  recently freed block is handed out first. Its cache lines may still be warm, and on the
  CPU (where the pool is ``torch.empty`` and pages are committed on first write) the
  resident memory stays at the blocks the traffic actually needs instead of creeping
  through the whole pool (measured: with a FIFO list the resident KV grew by ~120 MB a
  round of 16 requests until it reached the pool's size);
- the **cached list** if it is a full block of committed tokens with a prefix hash
  (:mod:`torch_topg.engine.kv_cache`): it keeps its contents and its hash until the
  allocator needs it (then it is *evicted*: its hash is forgotten, and the cache manager
  may first demote its contents to a lower tier). A lookup that finds it takes it back
  (count 1 again) without a copy. The list is in release order; which block goes first
  is the cache manager's policy (:meth:`allocate`'s ``pick``).

Invariants (checked by :meth:`check_whole` in the tests after every request, and by the
stateful hypothesis test): every block is exactly one of free (count 0, on the free
list once), cached (count 0, hashed, on the cached list once) or held (count > 0); a
hash names at most one block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class OutOfBlocks(Exception):
    """Raised by :meth:`BlockPool.allocate` when the pool cannot satisfy a request."""


#: ``pick(cached, count)``: which ``count`` cached blocks to evict (oldest release first
#: by default); ``evict(block, hash)`` runs before an evicted block is handed out.
Pick = Callable[["OrderedDict[int, None]", int], list[int]]
Evict = Callable[[int, bytes], None]


def oldest_first(cached: OrderedDict[int, None], count: int) -> list[int]:
    it = iter(cached)
    return [next(it) for _ in range(count)]


class BlockPool:
    """Free list, cached list and reference counts of ``num_blocks`` KV blocks."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockPool: num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"BlockPool: block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() gives 0 first
        self._refs = [0] * num_blocks
        self._cached: OrderedDict[int, None] = OrderedDict()  # count 0, hashed; release order
        self._hash: list[bytes | None] = [None] * num_blocks
        self._by_hash: dict[bytes, int] = {}
        self.pick: Pick = oldest_first
        self.on_evict: Evict | None = None
        self.num_evicted = 0

    # --- sizes -------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks :meth:`allocate` can hand out (free, or cached and evictable)."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        """Blocks held by running sequences."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks not held that keep a reusable prefix."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # --- allocation --------------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """``count`` blocks (reference count 1 each), or :class:`OutOfBlocks`.

        Free blocks first; then cached ones chosen by :attr:`pick`, each evicted (its
        hash forgotten, :attr:`on_evict` called with it first).
        """
        if count > self.num_free:
            raise OutOfBlocks(f"need {count} blocks, {self.num_free} free")
        out = [self._free.pop() for _ in range(min(count, len(self._free)))]
        short = count - len(out)
        if short:
            victims = self.pick(self._cached, short)
            if len(victims) != short or len(set(victims)) != short:
                raise RuntimeError(f"BlockPool: eviction policy picked {victims} for {short}")
            for b in victims:
                del self._cached[b]  # KeyError: the policy picked a block not cached
                h = self._hash[b]
                assert h is not None
                if self.on_evict is not None:
                    self.on_evict(b, h)
                self._forget(b)
                self.num_evicted += 1
            out.extend(victims)
        for b in out:
            self._refs[b] = 1
        return out

    def share(self, blocks: list[int]) -> None:
        """One more holder for each of ``blocks`` (held, or cached: taken back)."""
        for b in blocks:
            if self._refs[b] == 0:
                if b not in self._cached:
                    raise RuntimeError(f"BlockPool.share: block {b} is free")
                del self._cached[b]
            self._refs[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder of each of ``blocks``; the last one releases it (to the cached
        list if hashed, else to the free list). Callers release a sequence's blocks
        deepest first, so among blocks released together the deeper ones go first."""
        for b in blocks:
            refs = self._refs[b]
            if refs <= 0:
                raise RuntimeError(f"BlockPool.free: block {b} is already free")
            self._refs[b] = refs - 1
            if refs == 1:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._cached[b] = None

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # --- the prefix index --------------------------------------------------------------
    def lookup(self, h: bytes) -> int | None:
        """The block holding the prefix with hash ``h`` (held or cached), or None."""
        return self._by_hash.get(h)

    def hash_of(self, block: int) -> bytes | None:
        return self._hash[block]

    def register(self, block: int, h: bytes) -> bool:
        """Name held ``block`` by its prefix hash; False (nothing changes) when another
        block already has that hash (two sequences computed the same prefix) or the
        block has a hash already."""
        if self._refs[block] <= 0:
            raise RuntimeError(f"BlockPool.register: block {block} is not held")
        if self._hash[block] is not None or h in self._by_hash:
            return False
        self._hash[block] = h
        self._by_hash[h] = block
        return True

    def cached_blocks(self) -> list[int]:
        """Cached blocks in release order (oldest first)."""
        return list(self._cached)

    def evict_first(self, blocks: list[int]) -> None:
        """Move each of ``blocks`` that is cached to the front of the eviction order, in
        turn (so the last one listed goes first); held or free blocks are ignored."""
        for b in blocks:
            if b in self._cached:
                self._cached.move_to_end(b, last=False)

    def _forget(self, b: int) -> None:
        h = self._hash[b]
        if h is not None:
            del self._by_hash[h]
            self._hash[b] = None

    def drop_cached(self) -> int:
        """Forget every cached block (they become free); returns how many."""
        n = len(self._cached)
        for b in list(self._cached):
            del self._cached[b]
            self._forget(b)
            self._free.append(b)
        return n

    # --- checks ------------------------------------------------------------------------
    def check_whole(self) -> None:
        """No block is held, and every block is free or cached exactly once."""
        held = [b for b, r in enumerate(self._refs) if r != 0]
        listed = self._free + list(self._cached)
        if held or len(listed) != self.num_blocks or len(set(listed)) != self.num_blocks:
            raise AssertionError(
                f"KV pool not whole: {len(held)} blocks held ({held[:16]}...), "
                f"{len(self._free)} free + {len(self._cached)} cached of {self.num_blocks}"
            )
        self.check_consistent()

    def check_consistent(self) -> None:
        """The invariants of the module docstring (held blocks allowed)."""
        free, cached = set(self._free), set(self._cached)
        if len(free) != len(self._free) or free & cached:
            raise AssertionError("KV pool: a block is listed twice")
        for b in range(self.num_blocks):
            r = self._refs[b]
            if r < 0:
                raise AssertionError(f"KV pool: block {b} has count {r}")
            where = (b in free) + (b in cached) + (r > 0)
            if where != 1:
                raise AssertionError(f"KV pool: block {b} is in {where} states")
            if b in free and self._hash[b] is not None:
                raise AssertionError(f"KV pool: free block {b} keeps a hash")
            if b in cached and self._hash[b] is None:
                raise AssertionError(f"KV pool: cached block {b} has no hash")
        for h, b in self._by_hash.items():
            if self._hash[b] != h:
                raise AssertionError(f"KV pool: hash index names block {b} wrongly")
        if sum(h is not None for h in self._hash) != len(self._by_hash):
            raise AssertionError("KV pool: hash index and block hashes disagree")
