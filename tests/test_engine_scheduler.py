"""The scheduler and block pool alone (no model), driven by hypothesis: random request
lengths, pool sizes, budgets and aborts. Every step respects the token budget, the
batch limit and the pool; a sequence's blocks always cover its tokens and are its own;
every request finishes; the pool is whole at the end."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from torch_topg.engine.block_pool import BlockPool, OutOfBlocks
from torch_topg.engine.outputs import RequestHandle
from torch_topg.engine.sampling import SamplingParams
from torch_topg.engine.scheduler import Scheduler
from torch_topg.engine.sequence import Request, Status


def _request(i: int, prompt_len: int, max_new: int) -> Request:
    return Request(
        request_id=f"r{i}", prompt=None, prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_new_tokens=max_new), max_tokens=max_new,
        eos_ids=frozenset(), tokenizer=None, handle=RequestHandle(f"r{i}", lambda _: None),
        seed=i,
    )  # fmt: skip


@given(
    block_size=st.sampled_from([1, 2, 4, 16]),
    spare=st.integers(0, 40),
    max_batch=st.integers(1, 6),
    budget=st.integers(1, 40),
    reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12)), min_size=1, max_size=8),
    abort_at=st.lists(st.integers(0, 60), max_size=3),
)
@example(block_size=4, spare=0, max_batch=4, budget=8, reqs=[(30, 12)] * 4, abort_at=[])
def test_scheduler_invariants(block_size, spare, max_batch, budget, reqs, abort_at):
    # The pool holds at least the largest single request (as submit() guarantees).
    need = max(-(-(p + n) // block_size) for p, n in reqs)
    pool = BlockPool(need + spare, block_size)
    sched = Scheduler(pool, max_batch, budget)
    requests = [_request(i, p, n) for i, (p, n) in enumerate(reqs)]
    for r in requests:
        sched.add(r.seqs[0])
    for step in range(2000):
        if not sched.has_work():
            break
        if step in abort_at and sched.running:
            sched.finish(sched.running[0], "abort")
        out = sched.schedule()
        assert out.num_tokens <= budget
        assert len(sched.running) <= max_batch
        owned = [b for s in sched.running for b in s.blocks]
        assert len(owned) == len(set(owned)), "a block held by two sequences"
        assert pool.num_used == len(owned)
        for s in out.scheduled:
            assert s.num_new >= 1 and s.seq.status is Status.RUNNING
            assert len(s.seq.blocks) * block_size >= s.seq.num_computed + s.num_new
        samples = [s.seq for s in out.scheduled if s.samples]
        sched.update(out)
        for seq in samples:  # the "model": the next token is the position
            seq.token_ids.append(seq.num_tokens)
            seq.out.token_ids.append(seq.num_tokens)
            if len(seq.out.token_ids) >= seq.request.max_tokens:
                sched.finish(seq, "length")
    else:
        pytest.fail("the scheduler did not finish its requests")
    assert all(r.finished for r in requests)
    for r in requests:
        if r.seqs[0].finish_reason == "length":
            assert len(r.seqs[0].out.token_ids) == r.max_tokens
    pool.check_whole()


def test_block_pool_refcounts_and_errors():
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    pool.share(a[:2])
    pool.free(a)
    assert pool.num_free == 2  # the unshared block is back; the shared two are held once
    pool.free(a[:2])
    pool.check_whole()
    with pytest.raises(OutOfBlocks):
        pool.allocate(5)
    with pytest.raises(RuntimeError, match="already free"):
        pool.free([0])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 16)
