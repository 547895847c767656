"""The router's core: which replica a request goes to. Plain Python, no Ray.

What it knows:

- each replica's **load**: requests routed to it and not finished (:meth:`PrefixRouter.routed`,
  :meth:`PrefixRouter.done`), counted by the router itself, so it is exact for the
  requests that go through it and costs no round trip;
- each replica's **cached prefixes**: the chained block hashes its KV tiers hold, read
  from its KV events (:mod:`torch_topg.engine.kv_events`, vLLM's format) with
  :meth:`PrefixRouter.apply_events`; one index ``hash -> replicas holding it``;
- **sessions**: the replica each ``session_id`` (or ``user``) was last sent to.

The rule (:meth:`PrefixRouter.decide`), in order:

1. the session's replica, if it lives and is not over the load threshold;
2. the replica holding the longest cached prefix of the request's blocks (ties: the
   least loaded), if that prefix is at least ``min_prefix_share`` (0.5) of the
   request's blocks and the replica is not over the load threshold;
3. the least loaded replica (ties: the one chosen least recently).

*Over the load threshold*: more requests in flight than ``load_ratio`` (2.0) times the
least loaded replica's, counted as at least ``load_floor`` (4):
``inflight > load_ratio * max(least, load_floor)``, so that the first requests of a
burst on an idle cluster do not scatter sessions that a batch would take at no cost.

``min_prefix_share``: a prefix shorter than this share of the prompt (a chat template's
first tokens, a short system prompt under a long question) is not worth piling every new
conversation onto the one replica that has it; they are spread by load instead.

The decision walks the request's block hashes once (one dict lookup per block, stopping
at the first block no candidate holds): its cost does not grow with the number of
prefixes indexed (python/benchmarks/cluster_router.py measures it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from torch_topg.engine.kv_cache import chain_hash
from torch_topg.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

LOAD_RATIO = 2.0
LOAD_FLOOR = 4
MIN_PREFIX_SHARE = 0.5
MAX_SESSIONS = 100_000


class NoReplica(RuntimeError):
    """No live replica to route to."""


@dataclass
class Decision:
    replica: str
    reason: str  # "session", "prefix" or "least_load"
    prefix_blocks: int = 0  # blocks of the request the chosen replica holds


@dataclass
class _Replica:
    inflight: int = 0
    alive: bool = True
    cursor: int = 0  # the next KV event number expected from it
    held: dict[bytes, set[str]] = field(default_factory=dict)  # hash -> mediums
    last_chosen: int = 0


def block_hashes(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks an engine could reuse for a prompt of
    ``token_ids`` (as its ``KVCacheManager.match`` computes them: the last token is
    always computed, so a prompt of ``k * block_size`` tokens has ``k - 1``)."""
    out: list[bytes] = []
    parent = root
    for i in range((len(token_ids) - 1) // block_size):
        parent = chain_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


class PrefixRouter:
    """Session-, prefix- and load-aware choice among replicas (see the module docstring).

    Thread-safe: the decision and the updates take one lock (they are short)."""

    def __init__(
        self,
        load_ratio: float = LOAD_RATIO,
        load_floor: int = LOAD_FLOOR,
        min_prefix_share: float = MIN_PREFIX_SHARE,
        max_sessions: int = MAX_SESSIONS,
    ) -> None:
        self.configure(load_ratio, load_floor, min_prefix_share)
        self.max_sessions = max_sessions
        self.replicas: dict[str, _Replica] = {}
        self.index: dict[bytes, set[str]] = {}  # hash -> replicas holding it (any medium)
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.decisions: dict[str, int] = {"session": 0, "prefix": 0, "least_load": 0}
        self._tick = 0
        self._lock = threading.Lock()

    def configure(self, load_ratio: float, load_floor: int, min_prefix_share: float) -> None:
        """The thresholds (module docstring), each checked."""
        if (
            isinstance(load_ratio, bool)
            or not isinstance(load_ratio, int | float)
            or not load_ratio >= 1.0
        ):
            raise ValueError(f"load_ratio: expected a number >= 1, got {load_ratio!r}")
        if isinstance(load_floor, bool) or not isinstance(load_floor, int) or load_floor < 1:
            raise ValueError(f"load_floor: expected an int >= 1, got {load_floor!r}")
        if not isinstance(min_prefix_share, int | float) or not 0.0 <= min_prefix_share <= 1.0:
            raise ValueError(
                f"min_prefix_share: expected a number in [0, 1], got {min_prefix_share!r}"
            )
        self.load_ratio = float(load_ratio)
        self.load_floor = load_floor
        self.min_prefix_share = float(min_prefix_share)

    # --- membership --------------------------------------------------------------------
    def add_replica(self, replica: str) -> None:
        with self._lock:
            self.replicas.setdefault(replica, _Replica())

    def remove_replica(self, replica: str) -> None:
        """Forget a replica (scaled down, or replaced): its prefixes and its sessions."""
        with self._lock:
            self._forget_blocks(replica)
            self.replicas.pop(replica, None)

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """The replicas that exist now: new ones are added, missing ones forgotten."""
        now = set(replicas)
        for r in list(self.replicas):
            if r not in now:
                self.remove_replica(r)
        for r in now:
            self.add_replica(r)

    def mark_dead(self, replica: str) -> None:
        """A replica that died: no more requests; its index entries go (a replacement
        starts with an empty cache)."""
        with self._lock:
            rep = self.replicas.get(replica)
            if rep is not None:
                rep.alive = False
                self._forget_blocks(replica)

    def live(self) -> list[str]:
        return [r for r, s in self.replicas.items() if s.alive]

    # --- load --------------------------------------------------------------------------
    def routed(self, replica: str, session: str | None = None) -> None:
        """A request was sent to ``replica`` (its session now lives there)."""
        with self._lock:
            rep = self.replicas.get(replica)
            if rep is not None:
                rep.inflight += 1
            if session is not None:
                self.sessions[session] = replica
                self.sessions.move_to_end(session)
                while len(self.sessions) > self.max_sessions:
                    self.sessions.popitem(last=False)

    def done(self, replica: str) -> None:
        with self._lock:
            rep = self.replicas.get(replica)
            if rep is not None and rep.inflight > 0:
                rep.inflight -= 1

    # --- KV events ---------------------------------------------------------------------
    def apply_events(self, replica: str, sent_from: int, next_cursor: int, batch: KVEventBatch) -> None:  # fmt: skip
        """Events ``sent_from .. next_cursor`` of ``replica``'s log (an ``AllBlocksCleared``
        first when it started over). Batches may arrive out of order or overlap (several
        responses carry them): events already applied are skipped."""
        with self._lock:
            rep = self.replicas.get(replica)
            if rep is None or not rep.alive:
                return
            events = batch.events
            if events and isinstance(events[0], AllBlocksCleared):
                skip = 0  # the replica's log started over: take all of it
            else:
                skip = rep.cursor - sent_from
                if skip < 0:  # a gap (cannot happen with cursors sent in order): take it
                    skip = 0
                if next_cursor <= rep.cursor:
                    return
            for e in events[skip:]:
                if isinstance(e, BlockStored):
                    for h in e.block_hashes:
                        rep.held.setdefault(h, set()).add(e.medium or "")
                        self.index.setdefault(h, set()).add(replica)
                elif isinstance(e, BlockRemoved):
                    for h in e.block_hashes:
                        media = rep.held.get(h)
                        if media is None:
                            continue
                        media.discard(e.medium or "")
                        if not media:
                            del rep.held[h]
                            self._unindex(h, replica)
                elif isinstance(e, AllBlocksCleared):
                    self._forget_blocks(replica)
            rep.cursor = next_cursor

    def cursors(self) -> dict[str, int]:
        """Each replica's next expected event number (sent along with requests)."""
        return {r: s.cursor for r, s in self.replicas.items()}

    def _unindex(self, h: bytes, replica: str) -> None:
        holders = self.index.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.index[h]

    def _forget_blocks(self, replica: str) -> None:
        rep = self.replicas.get(replica)
        if rep is None:
            return
        for h in rep.held:
            self._unindex(h, replica)
        rep.held = {}

    # --- the decision ------------------------------------------------------------------
    def decide(
        self,
        hashes: list[bytes],
        session: str | None = None,
        candidates: Iterable[str] | None = None,
    ) -> Decision:
        """Where a request with prompt blocks ``hashes`` (and ``session``) goes, among
        ``candidates`` (default: every replica); dead replicas are never chosen.
        :class:`NoReplica` when none is left. Does not count the request: call
        :meth:`routed` once it is sent."""
        with self._lock:
            reps = self.replicas
            pool = [r for r in (reps if candidates is None else candidates)
                    if r in reps and reps[r].alive]  # fmt: skip
            if not pool:
                raise NoReplica("no live replica to route to")
            least = min(reps[r].inflight for r in pool)
            limit = self.load_ratio * max(least, self.load_floor)
            ok = set(r for r in pool if reps[r].inflight <= limit)
            sticky = self.sessions.get(session) if session is not None else None
            if sticky in ok:
                return self._chose(sticky, "session", 0)
            holders: set[str] = set()
            depth = 0
            for h in hashes:
                have = self.index.get(h)
                if not have:
                    break
                nxt = (have & set(pool)) if depth == 0 else (holders & have)
                if not nxt:
                    break
                holders, depth = nxt, depth + 1
            if depth and depth >= self.min_prefix_share * len(hashes):
                best = [r for r in holders if r in ok]
                if best:
                    return self._chose(self._least(best), "prefix", depth)
            return self._chose(self._least(pool), "least_load", 0)

    def _least(self, pool: list[str]) -> str:
        reps = self.replicas
        return min(pool, key=lambda r: (reps[r].inflight, reps[r].last_chosen))

    def _chose(self, replica: str, reason: str, depth: int) -> Decision:
        self._tick += 1
        self.replicas[replica].last_chosen = self._tick
        self.decisions[reason] += 1
        return Decision(replica, reason, depth)

    def state(self) -> dict[str, object]:
        """What the router knows, for ``GET /cluster`` and the metrics."""
        with self._lock:
            return {
                "load_ratio": self.load_ratio,
                "load_floor": self.load_floor,
                "min_prefix_share": self.min_prefix_share,
                "replicas": {
                    r: {
                        "inflight": s.inflight,
                        "alive": s.alive,
                        "blocks": len(s.held),
                        "sessions": sum(1 for v in self.sessions.values() if v == r),
                    }
                    for r, s in self.replicas.items()
                },
                "indexed_blocks": len(self.index),
                "sessions": len(self.sessions),
                "decisions": dict(self.decisions),
            }


_CORES: dict[str, PrefixRouter] = {}
_CORES_LOCK = threading.Lock()


def core_for(app: str, thresholds: tuple[float, int, float] | None = None) -> PrefixRouter:
    """The routing core of Serve application ``app`` in this process (made on first use;
    ``thresholds``: ``(load_ratio, load_floor, min_prefix_share)``): the ingress and
    Serve's request router of that application's handle share it."""
    with _CORES_LOCK:
        core = _CORES.get(app)
        if core is None:
            core = _CORES[app] = PrefixRouter()
        if thresholds is not None:
            core.configure(*thresholds)
        return core
