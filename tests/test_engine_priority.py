"""Priority scheduling (``scheduling_policy="priority"``): admission in (priority, arrival)
order; a higher-priority request that does not fit preempts the lowest-priority running
sequence, whose KV is parked in the host tier and comes back without recompute (the
engine's computed-token count shows it); greedy outputs equal a run without preemption.
The scheduler is also driven alone by hypothesis, with a "model" that writes each
position's token into the cache rows, so a parked sequence's rows are checked after it
comes back."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts, tiny, wait_idle, whole_pool
from hypothesis import example, given
from hypothesis import strategies as st

from torch_topg.engine import Engine
from torch_topg.engine.block_pool import BlockPool
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.kv_cache import KVCacheManager
from torch_topg.engine.model_runner import ModelRunner
from torch_topg.engine.outputs import RequestHandle
from torch_topg.engine.sampling import SamplingParams
from torch_topg.engine.scheduler import Scheduler
from torch_topg.engine.sequence import Request

BS = 4
LOW_NEW, HIGH_NEW = 30, 6


def _request(i: int, prompt_len: int, max_new: int, priority: int = 0) -> Request:
    return Request(
        request_id=f"r{i}", prompt=None, prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_new_tokens=max_new), max_tokens=max_new,
        eos_ids=frozenset(), tokenizer=None, handle=RequestHandle(f"r{i}", lambda _: None),
        seed=i, arrival=float(i), priority=priority,
    )  # fmt: skip


def test_admission_follows_priority_then_arrival():
    sched = Scheduler(BlockPool(64, BS), max_batch_size=1, max_num_batched_tokens=64,
                      policy="priority")  # fmt: skip
    reqs = [_request(i, 3, 1, p) for i, p in enumerate([2, 0, 1, 0, 2])]
    for r in reqs:
        sched.add(r.seqs[0])
    order = []
    while sched.has_work():
        out = sched.schedule()
        sched.update(out)
        for s in out.scheduled:
            order.append(s.seq.request.request_id)
            sched.finish(s.seq, "length")
    assert order == ["r1", "r3", "r2", "r0", "r4"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(BlockPool(4, BS), 1, 8, policy="lifo")


@given(
    block_size=st.sampled_from([1, 2, 4]),
    spare=st.integers(0, 12),
    host=st.integers(0, 24),
    max_batch=st.integers(1, 4),
    budget=st.integers(1, 24),
    reqs=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 10), st.integers(-2, 2), st.integers(0, 6)),
        min_size=1,
        max_size=7,
    ),
)
@example(
    block_size=4, spare=0, host=24, max_batch=2, budget=24, reqs=[(20, 10, 1, 0), (20, 10, 0, 3)]
)  # parks the first
@example(
    block_size=2,
    spare=2,
    host=2,
    max_batch=1,
    budget=4,
    reqs=[(9, 6, 2, 0), (3, 2, 0, 2), (5, 3, 1, 2)],
)  # no host room: recompute
def test_priority_scheduler_invariants_and_parked_rows(block_size, spare, host, max_batch,
                                                       budget, reqs):  # fmt: skip
    """Requests (prompt, new tokens, priority, step of arrival): every step keeps the
    budget, the batch limit and the pool; a sequence's computed rows always hold its
    tokens (parked ones too, when they come back); everything finishes; the pool and the
    host tier are whole at the end."""
    need = max(-(-(p + n) // block_size) for p, n, _, _ in reqs)
    pool = BlockPool(need + spare, block_size)
    cache = KVCacheManager(pool, enabled=False, host_blocks=host)
    rows = torch.full((pool.num_blocks, block_size), -1, dtype=torch.long)
    cache.bind([rows])
    sched = Scheduler(pool, max_batch, budget, cache=cache, policy="priority")
    requests = [_request(i, p, n, pr) for i, (p, n, pr, _) in enumerate(reqs)]
    arrive = {i: at for i, (_, _, _, at) in enumerate(reqs)}
    for step in range(3000):
        for i, at in arrive.items():
            if at == step:
                sched.add(requests[i].seqs[0])
        if not sched.has_work() and step > max(arrive.values()):
            break
        out = sched.schedule()
        assert out.num_tokens <= budget and len(sched.running) <= max_batch
        owned = [b for s in sched.running for b in s.blocks]
        assert len(owned) == len(set(owned)) and pool.num_used == len(owned)
        for s in out.scheduled:
            seq = s.seq
            for pos in range(seq.num_computed):  # what earlier steps wrote is still there
                assert rows[seq.blocks[pos // block_size], pos % block_size] == seq.token_ids[pos]
            for pos in range(seq.num_computed, seq.num_computed + s.num_new):
                rows[seq.blocks[pos // block_size], pos % block_size] = seq.token_ids[pos]
        samples = [s.seq for s in out.scheduled if s.samples]
        sched.update(out)
        for seq in samples:
            seq.token_ids.append(seq.num_tokens)
            seq.out.token_ids.append(seq.num_tokens)
            if len(seq.out.token_ids) >= seq.request.max_tokens:
                sched.finish(seq, "length")
    else:
        pytest.fail("the scheduler did not finish its requests")
    assert all(r.finished for r in requests)
    pool.check_whole()
    cache.check()


@pytest.fixture(scope="module")
def model():
    return tiny("llama-tiny")


def _engine(model, device_blocks: int, host_blocks: int, **kw) -> Engine:
    per = ModelRunner.bytes_per_block(model.config, BS, next(model.parameters()).dtype)
    host = {"host_kv_memory": host_blocks * per} if host_blocks else {}
    return Engine.from_model(model, block_size=BS, compile=False,
                             kv_cache_memory=device_blocks * per, **host, **kw)  # fmt: skip


def _low_then_high(eng: Engine, low: list[int], high: list[int]) -> list[list[int]]:
    """A long low-priority request, then (once it is running) a high-priority one that
    the pool cannot hold beside it; the outputs of both."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    h_low = eng.submit(low, priority=1, max_new_tokens=LOW_NEW, **greedy)
    deltas = iter(h_low)  # kept: a stream left early aborts its request
    next(deltas)  # running: its prompt's blocks are taken
    h_high = eng.submit(high, priority=0, max_new_tokens=HIGH_NEW, **greedy)
    for _ in deltas:
        pass
    return [h_low.result().outputs[0].token_ids, h_high.result().outputs[0].token_ids]


def test_preempted_kv_is_parked_in_the_host_tier_not_recomputed(model):
    low, high = prompts(11, [30, 28])
    g = dict(temperature=0.0, ignore_eos=True)
    with _engine(model, 64, 0) as ref:  # each alone: no preemption
        want = [ref.generate(x, max_new_tokens=k, **g)[0].outputs[0].token_ids
                for x, k in ((low, LOW_NEW), (high, HIGH_NEW))]  # fmt: skip
    # every token computed once: the prompts, and each output token but the last
    once = len(low) + LOW_NEW - 1 + len(high) + HIGH_NEW - 1
    # 16 blocks of 4: the low request holds 8 when the high one comes, grows to 15; the
    # high one needs 9: whichever way the steps fall, the two cannot both finish unparked
    with _engine(model, 16, 24, scheduling_policy="priority") as eng, whole_pool(eng):
        assert _low_then_high(eng, low, high) == want
        wait_idle(eng)
        st = eng.stats()
        assert st["requests"]["preemptions"] >= 1
        host = st["kv"]["tiers"]["host"]
        assert host["parked"] >= 1 and host["unparked"] == host["parked"]
        assert st["tokens"]["computed"] == once  # nothing recomputed
        eng.kv.check()
    # the same without a host tier: the preempted tokens are computed again
    with _engine(model, 16, 0, scheduling_policy="priority", prefix_caching=False) as eng:
        assert _low_then_high(eng, low, high) == want
        wait_idle(eng)
        st = eng.stats()
        assert st["requests"]["preemptions"] >= 1 and st["tokens"]["computed"] > once


def test_priority_needs_the_policy_and_an_int(model):
    with _engine(model, 16, 0) as eng:
        with pytest.raises(ParameterError, match="scheduling_policy='priority'"):
            eng.submit([1, 2, 3], priority=1)
        with pytest.raises(ParameterError, match="priority: expected an int, got 'high'"):
            eng.submit([1, 2, 3], priority="high")
    with pytest.raises(ParameterError, match="scheduling_policy: expected one of"):
        _engine(model, 16, 0, scheduling_policy="lifo")
