"""Continuous batching: which sequences run in the next step, and how many tokens each.

The scheduler owns the KV block pool and every sequence's block table. Each step gets
a token budget (``max_num_batched_tokens``) and a sequence limit (``max_batch_size``):

1. Running sequences first, oldest first: a decode takes one token; a prompt still
   being prefilled takes as much of the remaining budget as it needs (chunked
   prefill: a long prompt is spread over steps and decodes of the others go on beside
   it). A sequence that needs a block when none is free preempts the newest running
   sequence (its blocks are freed, it goes back to the front of the queue and is
   recomputed later: vLLM's recompute preemption), or itself if it is the newest.
2. Then waiting sequences, in arrival order, while budget, sequence slots and blocks
   last (none are admitted in a step that had to preempt). A sequence admitted with no
   blocks first takes the longest cached prefix of its tokens from the KV cache
   hierarchy (:mod:`torch_topg.engine.kv_cache`) and computes only the rest.

**Priority** (``policy="priority"``, vLLM's ``--scheduling-policy priority``): the
waiting queue and the running list are ordered by ``(priority, arrival)`` (lower value
first), so admission and the token budget go to the most urgent sequences, and a
preemption takes the lowest-priority running sequence instead of the newest. When the
head of the queue has a strictly better priority than a running sequence and does not
fit (no blocks or no batch slot), that sequence is preempted before the step. A
preempted sequence's KV is *parked* in the host tier when there is one
(:meth:`KVCacheManager.park`): its blocks are copied to host slots and come back into
fresh device blocks when it is admitted again, so none of its tokens is recomputed;
without a host tier (or with no room in it) it is recomputed as under ``"fcfs"``.

3. After the step, :meth:`Scheduler.update_from_output` appends each sequence's sampled
   tokens and ends it at a stop or a limit; ``n > 1`` samples start by :meth:`Scheduler.fork`
   from the first sample's prompt, within ``max_batch_size``.

Requests join and leave at every step; memory never grows past the pool.

With pipeline parallelism several steps (micro-batches) are in flight at once
(``engine/pipelined.py``): their sequences are :attr:`Scheduler.busy` until the step's
tokens are sampled, and :meth:`Scheduler.schedule` leaves them alone (never schedules nor
preempts them) and takes at most ``max_seqs`` sequences, so the running ones spread over
the micro-batches.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from torch_topg.engine.block_pool import BlockPool
from torch_topg.engine.kv_cache import KVCacheManager
from torch_topg.engine.sequence import Sequence, Status

POLICIES = ("fcfs", "priority")


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed this step: [seq.num_computed, + num_new)
    num_spec: int = 0  # of which speculative proposals (verified: 1 + num_spec rows)

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's end (its last logits are sampled)."""
        return self.seq.num_computed + self.num_new >= self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_batch_size: int,
        max_num_batched_tokens: int,
        cache: KVCacheManager | None = None,
        max_model_len: int | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.pool = pool
        self.max_model_len = max_model_len
        self.cache = cache or KVCacheManager(pool, enabled=False)
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        #: sequences of steps still in flight (pipeline parallel): not scheduled again,
        #: never preempted, until their step's tokens are sampled
        self.busy: set[Sequence] = set()

    # --- queue -------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if self.policy == "priority":
            self._queue(seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _key(seq: Sequence) -> tuple[int, float, int]:
        """Priority order: lower ``priority`` first, then earlier arrival, then sample."""
        return (seq.request.priority, seq.request.arrival, seq.index)

    def _queue(self, seq: Sequence) -> None:
        """Insert ``seq`` into the waiting queue in priority order, never before a head
        whose cached prefix is being copied up (see :meth:`_preempt`)."""
        head_loading = bool(self.waiting) and self.waiting[0].kv_load is not None
        i = 1 if head_loading else 0
        key = self._key(seq)
        while i < len(self.waiting) and self._key(self.waiting[i]) <= key:
            i += 1
        self.waiting.insert(i, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def wait_for_loads(self, timeout: float = 0.05) -> None:
        """Nothing could be scheduled: wait for a lower-tier copy instead of spinning."""
        self.cache.wait_for_loads(timeout)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (any state) and free its blocks."""
        if seq.status is Status.FINISHED:
            return
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.out.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.cache.release(seq)

    def commit(self, seqs: list[Sequence]) -> None:
        """Offer the sequences' newly completed blocks of committed tokens to the prefix
        cache (call after sampling: a token is committed once the step that computed it
        is final, i.e. after any rollback of rejected speculative tokens)."""
        for seq in seqs:
            if seq.blocks and not seq.finished:
                self.cache.commit(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        if not (self.policy == "priority" and self.cache.park(seq)):
            self._release(seq)  # recomputed when it comes back
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.policy == "priority":
            self._queue(seq)
            return
        # Back to the front of the queue, but behind a head whose cached prefix is being
        # copied up: that head holds its blocks across steps, and a sequence put before
        # it could wait forever for blocks only the head's admission releases (seen: an
        # idle engine spinning on a head that never fit).
        head_loading = bool(self.waiting) and self.waiting[0].kv_load is not None
        self.waiting.insert(1 if head_loading else 0, seq)

    def _grow(self, seq: Sequence, num_new: int) -> bool:
        """Give ``seq`` the blocks for ``num_new`` more tokens; False if the pool is short."""
        need = self.pool.blocks_for(seq.num_computed + num_new) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        seq.blocks.extend(self.pool.allocate(need))
        return True

    def fork(
        self, parent: Sequence, children: list[Sequence]
    ) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """``n > 1``: start ``children`` from ``parent``'s computed prompt, sharing its full
        blocks, as far as ``max_batch_size`` and the pool allow.

        A started child gets the parent's full blocks (reference counted, no copy) and,
        if the prompt ends inside a block, a fresh block for a copy of that partial block
        (its next token is written there); its first token is drawn from the parent's
        logits row. The children that do not fit now wait at the front of the queue and
        prefill on their own (the prompt's full blocks come from the prefix cache).
        Returns the children started and the ``(src, dst)`` block copies the runner
        must make for them.
        """
        bs = self.pool.block_size
        n = parent.num_computed
        full, partial = n // bs, n % bs != 0
        room = max(0, self.max_batch_size - len(self.running))
        if partial:
            room = min(room, self.pool.num_free)
        started, queued = children[:room], children[room:]
        copies = []
        for c in started:
            shared = parent.blocks[:full]
            self.pool.share(shared)
            c.blocks = list(shared)
            if partial:
                (dst,) = self.pool.allocate(1)
                c.blocks.append(dst)
                copies.append((parent.blocks[full], dst))
            c.num_computed = n
            c.status = Status.RUNNING
            self.running.append(c)
        if self.policy == "priority":
            for c in queued:
                self._queue(c)
        else:
            self.waiting.extendleft(reversed(queued))
        return started, copies

    # --- the step's output ---------------------------------------------------------------
    def update_from_output(
        self, seq: Sequence, tokens: list[int], logprobs: list[Any], now: float
    ) -> tuple[int, str | None]:
        """Append the tokens a step sampled for ``seq``, stopping at the first that ends
        it: an EOS or stop token id, a stop string (the detokenizer's), ``max_tokens`` or
        the context limit. A finished sequence's blocks are freed. Returns how many tokens
        were appended and the finish reason (None: it goes on)."""
        req = seq.request
        p = req.params
        for i, (tok, lp) in enumerate(zip(tokens, logprobs, strict=True)):
            stop_token = tok in req.eos_ids or tok in p.stop_token_ids
            # with skip_special_tokens the ending token's text is empty anyway (EOS is
            # special); without, it is left out of the text as vLLM does
            seq.append(tok, lp, now, text=not stop_token or p.skip_special_tokens)
            reason = None
            if stop_token or seq.detok.stopped:
                reason = "stop"
            elif len(seq.out.token_ids) >= req.max_tokens or (
                self.max_model_len is not None and seq.num_tokens >= self.max_model_len
            ):
                reason = "length"
            if reason is not None:
                self.finish(seq, reason)
                return i + 1, reason
        return len(tokens), None

    # --- the step ----------------------------------------------------------------------
    def _preempt_for_head(self, out: SchedulerOutput) -> None:
        """Priority: preempt the lowest-priority running sequences while the head of the
        queue has a strictly better priority and does not fit (no batch slot, or fewer
        free blocks than its first chunk and the running sequences' next tokens need)."""
        head = self.waiting[0]
        if head.kv_load is not None:  # admitted as soon as its copy ends
            return
        start = head.parked[1] if head.parked is not None else 0
        first = min(head.num_tokens, start + self.max_num_batched_tokens)
        need = self.pool.blocks_for(first) - len(head.blocks)
        budget = self.max_num_batched_tokens
        busy = self.busy
        while self.running and self.running[-1].request.priority > head.request.priority:
            if self.running[-1] in busy:  # in flight on another pipeline stage
                return
            grow = sum(
                max(0, self.pool.blocks_for(min(s.num_tokens + s.num_spec,
                                                s.num_computed + budget)) - len(s.blocks))
                for s in self.running
            )  # fmt: skip
            if len(self.running) < self.max_batch_size and self.pool.num_free >= need + grow:
                return
            self._preempt(self.running[-1], out)

    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """The next step: at most ``max_seqs`` sequences (default: as many as the budget
        and ``max_batch_size`` allow), none of them :attr:`busy`."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        limit = max_seqs or len(self.running) + len(self.waiting)
        busy = self.busy
        if self.policy == "priority":
            self.running.sort(key=self._key)  # the budget goes to the most urgent first
            if self.waiting:
                self._preempt_for_head(out)
        starved = False  # a running sequence lacked blocks: admit nobody this step
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < limit:
            seq = self.running[i]
            if seq in busy:
                i += 1
                continue
            n = min(seq.remaining + seq.num_spec, budget)
            if n > seq.remaining and not self._grow(seq, n):
                n = min(seq.remaining, budget)  # no blocks to speculate: a plain decode
            while not self._grow(seq, n):
                # the newest (fcfs) or lowest-priority (sorted) sequence not in flight
                victim = next(s for s in reversed(self.running) if s not in busy)
                self._preempt(victim, out)
                starved = True
                if victim is seq:
                    break
            else:
                seq.num_spec = max(0, n - seq.remaining)
                out.scheduled.append(ScheduledSeq(seq, n, seq.num_spec))
                budget -= n
                i += 1
        if starved:
            return out
        while (
            self.waiting
            and budget > 0
            and len(self.running) < self.max_batch_size
            and len(out.scheduled) < limit
        ):
            seq = self.waiting[0]
            if seq.parked is not None and not self.cache.unpark(seq, budget):
                break  # its parked KV comes back when the pool has room for it
            fresh = not seq.blocks and seq.num_computed == 0 and seq.kv_load is None
            if fresh and not seq.wants_prompt_rows:  # prompt logprobs: the whole prompt
                self.cache.match(seq)
            if not self.cache.load_done(seq):
                break  # its cached prefix is being copied up from a lower tier
            if seq.index == 0 and seq.num_preemptions == 0:
                seq.request.cached_prompt_tokens = seq.num_computed
            n = min(seq.remaining, budget)
            if not self._grow(seq, n):
                self._release(seq)  # its prefix hits stay cached for the next try
                seq.num_computed = 0
                if not self.running:  # nothing running will free blocks: take back what
                    for w in list(self.waiting)[1:]:  # queued sequences hold (cached)
                        if w.blocks or w.kv_load is not None:
                            self._release(w)
                            w.num_computed = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return out

    def rollback(self, seq: Sequence, num_computed: int) -> None:
        """A verify step rejected proposals: only ``num_computed`` positions hold committed
        tokens; blocks past them (allocated for rejected positions) go back to the pool."""
        seq.num_computed = num_computed
        keep = self.pool.blocks_for(num_computed)
        if len(seq.blocks) > keep:
            self.pool.free(seq.blocks[keep:])
            del seq.blocks[keep:]

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran: the scheduled tokens are in the cache."""
        for s in out.scheduled:
            s.seq.num_computed += s.num_new

    def stats(self) -> dict[str, int]:
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "preemptions": self.num_preemptions,
        }
