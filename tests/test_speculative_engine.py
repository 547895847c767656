"""Speculative decoding in the engine, on tiny transformers models: greedy and seeded
outputs identical with and without speculation for every method (prompt lookup, the
target's own first layers, a draft model), alone and in mixed batches with chunked
prefill, preemption, late arrivals and ``speculative=False`` requests; stop tokens, EOS
and max_tokens inside an accepted run; the KV of committed positions equal to the
non-speculative run's; the pool whole after every test; nothing compiled while
serving; the statistics; clear errors for bad options."""

from __future__ import annotations

import pytest
import torch
from engine_utils import prompts, tiny, whole_pool

from torch_topg.engine import Engine
from torch_topg.engine.kv_cache import chain_hash

pytest.importorskip("transformers")

GREEDY = dict(temperature=0, ignore_eos=True)
SAMPLED = dict(temperature=0.9, top_p=0.95, ignore_eos=True)


def _spec(method: str, **kw):
    if method == "ngram":
        base = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif method == "self":
        base = {"method": "self", "num_layers": 1}
    elif method == "draft":  # the same weights: every proposal accepted
        base = {"method": "draft", "model": tiny("llama-tiny")}
    else:  # another draft: most proposals rejected
        base = {"method": "draft", "model": tiny("llama-tiny", seed=7, num_hidden_layers=1)}
    return {**base, "adaptive": False, **kw}


METHODS = ["ngram", "self", "draft", "draft-other"]


def _engine(spec=None, **kw):
    kw = {"block_size": 4, "max_num_batched_tokens": 32, **kw}
    return Engine.from_model(tiny("llama-tiny"), speculative=spec, **kw)


def _looping_prompts():
    """Prompts whose continuations repeat (so prompt lookup finds proposals)."""
    ps = prompts(1, [9, 23, 4, 17, 12])
    return [p + p[:6] + p for p in ps]


@pytest.fixture(scope="module")
def plain():
    with _engine() as eng:
        yield eng


def _outputs(eng, ps, **kw):
    return [o.token_ids for o in eng.generate(ps, **kw)]


def test_adaptive_prompt_lookup_forgets_finished_sequences():
    """Prompt lookup keys the adaptive rule by (sequence, match length), 0 for a step that
    found nothing; once its sequences finish, the periodic prune leaves no state of them
    (a server runs for days)."""
    spec = {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with _engine(spec) as eng:
        eng.generate(_looping_prompts(), max_new_tokens=24, **GREEDY)
        sp = eng.proposer
        keys = list(sp.ctl._seqs)
        assert keys and all(isinstance(k, tuple) and 0 <= k[1] <= 3 for k in keys)
        assert sp.stats.proposals > 0
        sp._prune()
        assert sp.ctl._seqs == {} and sp._ngram == {} and sp._key == {}
        assert sp.ctl._groups  # the pooled rates per match length stay


@pytest.mark.parametrize("method", METHODS)
def test_greedy_and_seeded_outputs_equal_the_plain_engine(plain, method):
    ps = _looping_prompts()
    want = _outputs(plain, ps, max_new_tokens=20, **GREEDY)
    seeded = [plain.generate([p], max_new_tokens=20, seed=i, **SAMPLED)[0].token_ids
              for i, p in enumerate(ps)]  # fmt: skip
    with _engine(_spec(method, num_speculative_tokens=3)) as eng:
        with whole_pool(eng):
            assert _outputs(eng, ps, max_new_tokens=20, **GREEDY) == want
            # seeded sampling: the same tokens (coupled draws), batched together
            handles = [
                eng.submit(p, max_new_tokens=20, seed=i, **SAMPLED) for i, p in enumerate(ps)
            ]
            assert [h.result().token_ids for h in handles] == seeded
        st = eng.stats()
        sp = st["speculative"]
        assert sp["method"] == method.split("-")[0] and sp["proposals"] > 0
        if method == "draft":
            assert sp["acceptance_rate"] == 1.0 and sp["mean_accepted_length"] > 3
        assert st["compile"]["while_serving"] == 0


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_mixed_batch_late_arrivals_chunked_prefill_and_opt_out(plain, method):
    ps = _looping_prompts() + prompts(4, [40, 3])
    want = _outputs(plain, ps, max_new_tokens=16, **GREEDY)
    with _engine(_spec(method, num_speculative_tokens=4), max_num_batched_tokens=10) as eng:
        with whole_pool(eng):
            handles, streams = [], []
            for i, p in enumerate(ps):  # each arrives while the others decode
                handles.append(eng.submit(p, max_new_tokens=16, speculative=i % 3 != 1, **GREEDY))
                streams.append(iter(handles[-1]))
                next(streams[-1])
            outs = [h.result() for h in handles]
        assert [o.token_ids for o in outs] == want
        for i, o in enumerate(outs):
            if i % 3 == 1:  # opted out: never proposed
                assert o.outputs[0].speculative is None
        assert any(o.outputs[0].speculative for o in outs)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stop_token_eos_and_max_tokens_inside_an_accepted_run(plain, method):
    p = _looping_prompts()[1]
    free = _outputs(plain, [p], max_new_tokens=30, **GREEDY)[0]
    with _engine(_spec(method, num_speculative_tokens=4)) as eng:
        with whole_pool(eng):
            for j in (2, 5, 7, 13):
                stop = free[j]
                first = free.index(stop)
                out = eng.generate([p], max_new_tokens=30, temperature=0,
                                   stop_token_ids=[stop])[0]  # fmt: skip
                assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
                eng._eos = frozenset({stop})
                out = eng.generate([p], max_new_tokens=30, temperature=0)[0]
                assert out.token_ids == free[: first + 1] and out.finish_reason == "stop"
                eng._eos = frozenset()
            for n in (1, 3, 6, 11):
                out = eng.generate([p], max_new_tokens=n, **GREEDY)[0]
                assert out.token_ids == free[:n] and out.finish_reason == "length"
        if method == "draft":  # every step emits 5 tokens: the stops landed inside runs
            assert eng.stats()["speculative"]["mean_accepted_length"] > 3


def _committed_kv(eng, tokens):
    """The KV of every full block of ``tokens`` that the prefix cache holds, per layer."""
    bs = eng.pool.block_size
    h, out = eng.kv.root, []
    for i in range((len(tokens) - 1) // bs):
        h = chain_hash(h, tokens[i * bs : (i + 1) * bs])
        b = eng.pool.lookup(h)
        assert b is not None, f"block {i} not cached"
        out.append(torch.stack([c[b] for c in eng.runner.kv_caches]))
    return torch.stack(out)


@pytest.mark.parametrize("method", ["ngram", "draft-other"])
def test_kv_after_rejection_equals_the_plain_run(plain, method):
    p = _looping_prompts()[3]
    want = plain.generate([p], max_new_tokens=24, **GREEDY)[0]
    with _engine(_spec(method, num_speculative_tokens=4)) as eng:
        with whole_pool(eng):
            got = eng.generate([p], max_new_tokens=24, **GREEDY)[0]
        assert got.token_ids == want.token_ids
        sp = eng.stats()["speculative"]
        assert sp["proposed_tokens"] > sp["accepted_tokens"]  # some were rejected
        seq = p + got.token_ids
        a, b = _committed_kv(eng, seq), _committed_kv(plain, seq)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_preemption_and_logprobs_penalties_n_with_speculation():
    ps = _looping_prompts()[:4]
    per_block = 2 * 2 * 4 * 2 * 16 * 4
    kw = dict(kv_cache_memory=20 * per_block, max_num_batched_tokens=16, prefix_caching=False)
    opts = dict(max_new_tokens=14, temperature=0.8, seed=3, logprobs=2,
                repetition_penalty=1.3, presence_penalty=0.5, ignore_eos=True)  # fmt: skip
    with _engine(**kw) as eng:
        want = eng.generate(ps, **opts)
        want_n = eng.generate(ps[2], n=3, **{**opts, "logprobs": None, "max_new_tokens": 10})[0]
    with _engine(_spec("self", num_speculative_tokens=3), **kw) as eng:
        with whole_pool(eng):
            got = eng.generate(ps, **opts)
            got_n = eng.generate(ps[2], n=3, **{**opts, "logprobs": None, "max_new_tokens": 10})[0]
        assert eng.stats()["requests"]["preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert [o.token_ids for o in got_n.outputs] == [o.token_ids for o in want_n.outputs]


def test_adaptive_rule_runs_and_reports(plain):
    ps = _looping_prompts()
    want = _outputs(plain, ps, max_new_tokens=24, **GREEDY)
    with _engine(_spec("ngram", adaptive=True, num_speculative_tokens=6)) as eng:
        with whole_pool(eng):
            outs = eng.generate(ps, max_new_tokens=24, **GREEDY)
        assert [o.token_ids for o in outs] == want
        sp = eng.stats()["speculative"]
    assert set(sp) >= {"proposals", "proposed_tokens", "accepted_tokens", "acceptance_rate",
                       "acceptance_per_position", "mean_accepted_length", "cost_curve_s"}  # fmt: skip
    assert sorted(sp["cost_curve_s"])[:7] == list(range(1, 8))  # the start-up profile
    per = [o.outputs[0].speculative for o in outs if o.outputs[0].speculative]
    assert sum(d["proposals"] for d in per) == sp["proposals"]


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"method": "draft", "model": None}, "needs 'model'"),
        ({"method": "eagle"}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "self", "num_layers": 2}, r"num_layers must be in \[1, 1\]"),
    ],
)
def test_bad_options_are_clear_errors(spec, words):
    with pytest.raises(ValueError, match=words):
        _engine(spec)


def test_draft_with_another_vocabulary_is_refused():
    other = tiny("llama-tiny", vocab_size=300)
    with pytest.raises(ValueError, match=r"vocabulary \(300 tokens\) differs .* \(256\)"):
        _engine({"method": "draft", "model": other})
    with pytest.raises(ValueError, match="speculative must be a bool"):
        with _engine(_spec("ngram")) as eng:
            eng.submit([1, 2, 3], speculative="no")
