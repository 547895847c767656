"""Speculative decoding units (torch_topg.engine.speculative): the ``speculative=``
config, prompt-lookup proposals, the verification rules (exact for greedy; for
sampling the distribution of the first two tokens equals the plain sampler's, by
chi-square, for a draft that agrees with the target and one that does not), the
adaptive rule and the statistics. The engine integration is tested in
``test_speculative_engine.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_topg.engine.sampling import Sampler, SamplingParams, sample_from_probs, seed_tensor
from torch_topg.engine.speculative import (
    AdaptiveController,
    CostModel,
    NgramIndex,
    SpecStats,
    accept_coupled,
    parse_speculative,
    propose_ngram_numpy,
    rejection_sample,
)
from torch_topg.engine.speculative.config import check_num_layers
from torch_topg.engine.speculative.ngram import propose_ngram_reference
from torch_topg.engine.speculative.rejection import SALT_DRAFT
from torch_topg.engine.speculative.speculator import joined_rows, rows_of

# --------------------------------------------------------------------------- config


def test_config_parses_vllm_keys():
    c = parse_speculative(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
    )  # fmt: skip
    assert (c.method, c.k, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 1, 3)
    assert c.adaptive
    assert parse_speculative(None) is None
    d = parse_speculative({"method": "draft", "model": "some/path"})
    assert d.model == "some/path" and d.k == 4
    s = parse_speculative({"method": "self", "num_layers": 8, "adaptive": False})
    assert s.num_layers == 8 and not s.adaptive
    check_num_layers(s, 30)


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"method": "medusa"}, "unknown method 'medusa'"),
        ({"num_speculative_tokens": 3}, "unknown method None"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in [1"),
        ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2.5}, "must be an int"),
        ({"method": "ngram", "num_speculative_tokens": True}, "must be an int"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_max"),
        ({"method": "ngram", "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "model": "x"}, "do not apply to method 'ngram'"),
        ({"method": "ngram", "num_speculative_token": 3}, "num_speculative_token"),
        ({"method": "draft"}, "needs 'model'"),
        ({"method": "self"}, "needs 'num_layers'"),
        ({"method": "self", "num_layers": 0}, "num_layers"),
        ({"method": "ngram", "adaptive": "yes"}, "adaptive"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("ngram", "expected a dict"),
    ],
)
def test_config_errors_name_the_key(spec, words):
    with pytest.raises(ValueError, match="speculative") as e:
        parse_speculative(spec)
    assert words in str(e.value)


def test_self_draft_must_be_shallower():
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 29\]"):
        check_num_layers(parse_speculative({"method": "self", "num_layers": 30}), 30)


# --------------------------------------------------------------------------- n-gram


def test_ngram_examples():
    t = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    assert propose_ngram_reference(t, 3, 2, 3) == [4, 5, 9]
    assert propose_ngram_reference(t, 8, 2, 3) == [4, 5, 9, 1, 2, 3]
    assert propose_ngram_reference([1, 2, 3], 3, 2, 3) == []
    # the longest n wins over a later, shorter match
    t = [7, 1, 2, 5, 8, 2, 6, 9, 1, 2]
    assert propose_ngram_reference(t, 2, 1, 2) == [5, 8]
    assert propose_ngram_reference(t, 2, 1, 1) == [6, 9]  # latest "2"
    # a run continues itself
    assert propose_ngram_reference([4, 4, 4, 4], 3, 2, 2) == [4]


@given(
    tokens=st.lists(st.integers(0, 4), min_size=0, max_size=80),
    k=st.integers(1, 6),
    nmin=st.integers(1, 3),
    extra=st.integers(0, 2),
)
def test_ngram_index_and_numpy_match_the_reference(tokens, k, nmin, extra):
    nmax = nmin + extra
    idx = NgramIndex(nmin, nmax)
    # grow the sequence as the engine does (a lookup after every few committed tokens)
    for end in range(0, len(tokens) + 1, 3):
        want = propose_ngram_reference(tokens[:end], k, nmin, nmax)
        assert idx.propose(tokens[:end], k) == want
    want = propose_ngram_reference(tokens, k, nmin, nmax)
    assert idx.propose(tokens, k) == want
    assert propose_ngram_numpy(tokens, k, nmin, nmax) == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_joined_rows_is_a_view_when_rows_are_in_order(dtype):
    logits = torch.randn(9, 11).to(dtype)
    views = [r.view(-1, 11) for r in rows_of(logits, [1, 0, 3, 1, 2]) if r is not None]
    got = joined_rows(views)
    assert torch.equal(got, torch.cat(views)) and got.data_ptr() == logits.data_ptr()
    assert joined_rows(views[1:]).data_ptr() == logits[1].data_ptr()
    # a row used twice (a fork's children), rows out of order, or another tensor: a copy
    for vs in (
        [views[0], views[0]],
        [views[1], views[0]],
        [views[0], torch.randn(1, 11).to(dtype)],
    ):
        got = joined_rows(vs)
        assert torch.equal(got, torch.cat(vs)) and got.data_ptr() != logits.data_ptr()
    assert joined_rows(views[:1]) is views[0]


def test_ngram_lookup_gives_the_match_length():
    idx = NgramIndex(1, 3)
    t = [7, 1, 2, 5, 8, 2, 6, 9, 1, 2]
    assert idx.lookup(t, 2) == ([5, 8], 2)
    assert idx.lookup([*t, 3], 2) == ([], 0)
    assert NgramIndex(1, 1).lookup(t, 2) == ([6, 9], 1)
    assert NgramIndex(2, 3).lookup([1, 2, 3], 2) == ([], 0)


def test_ngram_index_refuses_a_shrunk_sequence():
    idx = NgramIndex(2, 3)
    idx.propose([1, 2, 3, 1, 2], 2)
    with pytest.raises(ValueError, match="shrank"):
        idx.propose([1, 2], 2)
    with pytest.raises(ValueError, match="nmin"):
        NgramIndex(3, 2)


# --------------------------------------------------------------------------- verification
#
# A toy "model" over a small vocabulary: the next token's logits depend on the last token
# only (a bigram table), so target rows for proposals are table lookups.

V = 5
N_SEEDS = 12000
POS0 = 7  # the index of the first generated token


def _table(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(V, V, generator=g) * 2 - 1) * scale


TARGET = _table(0, 1.2)
AGREE = TARGET.clone()
DISAGREE = -2.0 * TARGET + _table(5, 0.5)  # favours what the target does not
PARAMS = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def _draw(sampler, table, last, seeds, pos, params):
    return sampler(table[last], [params] * len(last), seeds, pos).tokens


def _plain(n, seeds, params=PARAMS, start=0):
    """The non-speculative engine: one keyed draw per position."""
    s = Sampler()
    last = torch.full((len(seeds),), start, dtype=torch.long)
    out = []
    for i in range(n):
        last = _draw(s, TARGET, last, seeds, torch.full_like(seeds, POS0 + i), params)
        out.append(last)
    return torch.stack(out, 1)


def _speculative(n, seeds, k, draft, form, params=PARAMS, proposals=None):
    """Rounds of propose + verify until every row has ``n`` tokens; returns the first ``n``
    and the acceptance rate. ``form``: "coupled" (the engine's) or "textbook"."""
    s = Sampler()
    S = len(seeds)
    outs = [[] for _ in range(S)]
    last = torch.zeros(S, dtype=torch.long)
    pos = torch.full((S,), POS0, dtype=torch.long)
    proposed = accepted = 0
    while min(len(o) for o in outs) < n:
        # proposals d_0..d_{k-1}
        ds, qs, prev = [], [], last
        for i in range(k):
            if proposals is not None:
                d = proposals[:, i]
                q = None
            elif form == "coupled":  # the draft races with the target's key
                d = _draw(s, draft, prev, seeds, pos + i, params)
                q = None
            else:
                q = s.processed_probs(draft[prev], [params] * S)
                d = sample_from_probs(q, seeds, pos + i, SALT_DRAFT)
            ds.append(d)
            qs.append(q)
            prev = d
        d = torch.stack(ds, 1)
        lasts = torch.cat([last.unsqueeze(1), d], 1)  # the context of row i: lasts[:, i]
        nd = torch.full((S,), k, dtype=torch.long)
        if form == "coupled":
            x = torch.stack(
                [_draw(s, TARGET, lasts[:, i], seeds, pos + i, params) for i in range(k + 1)], 1
            )
            a = accept_coupled(x, d, nd)
            tokens = x
        else:
            p = torch.stack(
                [s.processed_probs(TARGET[lasts[:, i]], [params] * S) for i in range(k + 1)], 1
            )
            q = None if qs[0] is None else torch.stack(qs, 1)
            tokens, a = rejection_sample(p, d, nd, seeds, pos, q)
        proposed += S * k
        accepted += int(a.sum())
        for r in range(S):
            outs[r].extend(tokens[r, : int(a[r]) + 1].tolist())
        last = tokens.gather(1, a.unsqueeze(1)).squeeze(1)
        pos = pos + a + 1
    return torch.tensor([o[:n] for o in outs]), accepted / proposed


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    exp = n * probs
    assert exp.min() >= 5, "test set-up: an expected count below 5"
    stat = float(((counts - exp) ** 2 / exp).sum())
    df = probs.size - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def _joint_first_two() -> np.ndarray:
    p = torch.softmax(TARGET.double(), -1)
    return (p[0].unsqueeze(1) * p).numpy().reshape(-1)  # P(t1) P(t2 | t1)


def _counts(tokens: torch.Tensor) -> np.ndarray:
    return np.bincount((tokens[:, 0] * V + tokens[:, 1]).numpy(), minlength=V * V)


SEEDS = seed_tensor(range(10_000, 10_000 + N_SEEDS))


def test_plain_sampler_follows_the_joint():
    assert _chi2_pvalue(_counts(_plain(2, SEEDS)), _joint_first_two()) > 1e-4


@pytest.mark.parametrize("draft", ["agree", "disagree"])
@pytest.mark.parametrize("form", ["coupled", "textbook"])
def test_first_two_tokens_follow_the_target(form, draft):
    table = AGREE if draft == "agree" else DISAGREE
    tokens, rate = _speculative(2, SEEDS, 2, table, form)
    assert _chi2_pvalue(_counts(tokens), _joint_first_two()) > 1e-4
    # and the two samplers' histograms agree (two-sample chi-square over the 25 cells)
    a, b = _counts(tokens), _counts(_plain(2, SEEDS))
    both = a + b
    stat = float((((a - b) ** 2) / np.maximum(both, 1)).sum())
    assert float(torch.special.gammaincc(torch.tensor(12.0), torch.tensor(stat / 2))) > 1e-4
    if draft == "agree":
        assert rate > (0.999 if form == "textbook" else 0.99)
    else:
        assert 0.02 < rate < 0.6


def test_fixed_proposals_textbook_rule_is_exact():
    """q one-hot (prompt lookup): accept with probability p(d), else the residual."""
    g = torch.Generator().manual_seed(3)
    props = torch.randint(0, V, (N_SEEDS, 2), generator=g)
    tokens, _ = _speculative(2, SEEDS, 2, None, "textbook", proposals=props)
    assert _chi2_pvalue(_counts(tokens), _joint_first_two()) > 1e-4


@pytest.mark.parametrize("draft", ["agree", "disagree"])
def test_coupled_tokens_equal_the_plain_sampler_for_every_k(draft):
    """The engine's form: every emitted token is the non-speculative engine's token."""
    table = AGREE if draft == "agree" else DISAGREE
    seeds = SEEDS[:500]
    want = _plain(6, seeds)
    for k in (1, 2, 4):
        got, _ = _speculative(6, seeds, k, table, "coupled")
        assert torch.equal(got, want), k
    g = torch.Generator().manual_seed(9)
    props = torch.randint(0, V, (500, 3), generator=g)
    got, _ = _speculative(6, seeds, 3, None, "coupled", proposals=props)
    assert torch.equal(got, want)


@given(
    seed=st.integers(0, 2**20), k=st.integers(1, 6), form=st.sampled_from(["coupled", "textbook"])
)
def test_greedy_is_the_argmax_chain_whatever_the_proposals(seed, k, form):
    seeds = seed_tensor(range(seed, seed + 16))
    want = _plain(8, seeds, GREEDY)
    g = torch.Generator().manual_seed(seed)
    props = torch.randint(0, V, (16, k), generator=g)
    # proposals that are partly right: the true chain with some tokens changed
    chain = _plain(k, seeds, GREEDY)
    props = torch.where(torch.rand(16, k, generator=g) < 0.6, chain, props)
    got, _ = _speculative(8, seeds, k, None, form, GREEDY, proposals=props)
    assert torch.equal(got, want)


def test_accept_coupled_shapes_and_padding():
    target = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 9, 3], [4, 4, 4]])
    draft = torch.tensor([[1, 2], [1, 2], [1, 2], [5, 5]])
    assert accept_coupled(target, draft, torch.tensor([2, 1, 2, 2])).tolist() == [2, 1, 1, 0]
    assert (
        accept_coupled(target[:, :1], draft[:, :0], torch.zeros(4, dtype=torch.long)).tolist()
        == [0] * 4
    )
    with pytest.raises(ValueError, match="disagree"):
        accept_coupled(target, draft[:, :1], torch.tensor([1, 1, 1, 1]))


def test_rejection_sample_refuses_bad_shapes():
    p = torch.full((2, 3, V), 1 / V)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(p, torch.zeros(2, 2, dtype=torch.long), torch.tensor([2, 2]),
                         torch.tensor([1, 2]), torch.tensor([0, 0]), torch.zeros(2, 1, V))  # fmt: skip


# --------------------------------------------------------------------------- adaptive


def test_cost_model_monotone_fit_ignores_bursts():
    c = CostModel(window=8)
    assert c(5) == 1.0  # unmeasured: flat
    c.observe(1, 0.010)
    assert c(1) == c(9) == 0.010  # one count: flat
    c.observe(3, 0.014)
    assert c(2) == pytest.approx(0.012) and c(5) == pytest.approx(0.018)
    c.observe(3, 0.014)
    c.observe(3, 0.014)
    for _ in range(2):
        c.observe(3, 0.050)  # a neighbour's burst: the median stays
    assert c(3) == pytest.approx(0.014)
    for _ in range(8):
        c.observe(3, 0.024)  # a lasting change moves it within a window
    assert c(3) == pytest.approx(0.024)
    d = CostModel()
    for _ in range(9):
        d.observe(1, 0.020)
    d.observe(2, 0.010)  # a noisy cheap point: pooled with its neighbour, never cheaper
    d.observe(4, 0.030)
    assert d(1) == d(2) == pytest.approx(0.019)
    assert d(4) == 0.030 and d(3) == pytest.approx(0.0245)
    assert list(d.points()) == [1, 2, 4]


def test_cost_model_work_is_bounded():
    """Every prefill size is a count: a long-running server must not refit over all of
    them every step (600 counts took 0.53 ms a refit before the bound)."""
    c = CostModel(max_counts=64)
    for T in range(1, 10):
        c.seed(T, 0.01 + 0.001 * T)
    for T in range(1, 600):
        c.observe(T, 0.01 + 0.0001 * T)
    assert len(c._obs) == 64 and min(c._obs) == 600 - 64  # the latest 64 kept
    for _ in range(200):  # the horizon passes: the old counts only restate the prior
        c.observe(8, 0.011)
    assert set(c.points()) == set(range(1, 10))
    assert c(9) >= c(8) == pytest.approx(0.011, rel=0.05)


def test_cost_model_rare_count_is_not_cheaper_than_the_common_one():
    # The batch-8 case: the plain count seen every step, one more token seen twice, both
    # with the same spread. The fitted curve must keep the extra token's cost (a lower
    # quartile made the rare count's minimum look cheaper than the common count's
    # quartile, and the fit then pooled them into a flat segment).
    c = CostModel()
    spread = [0.0150, 0.0145, 0.0170, 0.0140, 0.0160, 0.0155, 0.0148, 0.0165] * 2
    for t in spread:
        c.observe(8, t)
    c.observe(9, 0.0142 + 0.0007)
    c.observe(9, 0.0165 + 0.0007)
    assert c(9) - c(8) > 0.0005


def test_cost_model_prices_rare_counts_by_the_profile_shape_at_todays_level():
    c = CostModel(horizon=32)
    for T, t in ((8, 0.010), (9, 0.011), (12, 0.014)):  # start-up profile, short context
        c.seed(T, t)
    assert c(9) == pytest.approx(0.011)
    c.observe(9, 0.0105)  # seen once early, at a short context
    for _ in range(40):  # later steps at a longer context: the plain count costs more
        c.observe(8, 0.015)
    # the early 9 is older than the horizon: t(9) follows the profile from today's t(8)
    assert c(8) == pytest.approx(0.015)
    assert c(9) == pytest.approx(0.015 * 1.1) and c(12) == pytest.approx(0.015 * 1.4)
    assert c(10) == pytest.approx(0.015 * 1.2)  # between profile points: interpolated
    c.observe(9, 0.0140)  # measured now, once: pulled towards the prior (4 to 1)
    assert c(9) == pytest.approx((0.0140 + 4 * 0.0165) / 5)
    for _ in range(12):
        c.observe(9, 0.0180)  # measured often: its own median dominates
    assert c(9) == pytest.approx((13 * 0.018 + 4 * 0.0165) / 17)
    # without a profile, a count keeps its measurements however old
    d = CostModel(horizon=4)
    d.observe(2, 0.02)
    for _ in range(10):
        d.observe(1, 0.01)
    assert d(2) == pytest.approx(0.02)


_cost_ops = st.lists(
    st.tuples(
        st.sampled_from(["observe", "observe", "observe", "seed"]),
        st.integers(1, 12),
        st.sampled_from([0.0, -1.0, 0.010, 0.011, 0.012, 0.015, 0.020, 0.050]),
    ),
    max_size=80,
)


@given(ops=_cost_ops, horizon=st.integers(1, 12), window=st.integers(1, 6),
       max_counts=st.integers(1, 8))  # fmt: skip
def test_cost_model_cached_fit_equals_the_refit(ops, horizon, window, max_counts):
    """The fit from cached per-count medians equals the fit from every measurement after
    any history: counts leaving the horizon, the window and the bound on counts, seeds
    after observations, rejected measurements."""
    c = CostModel(window=window, horizon=horizon, max_counts=max_counts)
    for op, T, s in ops:
        getattr(c, op)(T, s)
        assert c._fit() == c._fit_reference()
        assert c.at(range(1, 14)) == [c(T) for T in range(1, 14)]


def _flat(t1=0.02, slope=0.0):
    c = CostModel()
    for T in (1, 2, 4, 8, 16, 64, 128):
        c.observe(T, t1 + slope * (T - 1))
    return c


def test_plan_speculates_when_it_pays_and_not_otherwise():
    ctl = AdaptiveController(k_max=4, cost=_flat(), probe_every=0)
    for _ in range(20):
        ctl.observe("good", 4, 4)
        ctl.observe("bad", 4, 0)
    assert ctl.acceptance("good") > 0.9 and ctl.acceptance("bad") < 0.2
    # a memory-bound step (flat cost): the good sequence proposes all 4
    ks = ctl.plan([("good", 4), ("bad", 4), ("new", 2)], base_tokens=3)
    assert ks[0] == 4 and ks[2] <= 2
    # a step whose cost grows with every token (compute-bound): the poor proposals go
    steep = AdaptiveController(k_max=4, cost=_flat(0.02, 0.01), probe_every=0)
    for _ in range(20):
        steep.observe("bad", 4, 0)
    assert steep.plan([("bad", 4)], base_tokens=1) == [0]
    # a large batch whose step time is proportional to its tokens: nothing pays
    big = AdaptiveController(k_max=4, cost=_flat(0.001, 0.001), probe_every=0)
    for _ in range(20):
        big.observe("x", 4, 2)
    assert big.plan([("x", 4)] * 32, base_tokens=32) == [0] * 32
    # caps are respected; not adaptive: the caps
    assert AdaptiveController(k_max=3, adaptive=False).plan([("a", 5), ("b", 1)], 2) == [3, 1]
    assert AdaptiveController(k_max=3, disable_by_batch_size=2).plan([("a", 3), ("b", 3)], 2) == [
        0,
        0,
    ]


def test_a_closed_batch_needs_the_larger_margin():
    """A batch no request waits to join speculates only for a predicted gain above
    ``closed_min_gain``: its length is set by its slowest sequence."""
    ctl = AdaptiveController(k_max=4, cost=_flat(0.0065, 0.0005), probe_every=0)
    for _ in range(40):  # ~0.8: the best plan gains ~8% (5% more time per token)
        ctl.observe("a", 5, 4)
        ctl.observe("b", 4, 4)
    assert 0.75 < ctl.acceptance("a") < 0.85 and ctl.acceptance("b") > 0.95
    others = [(f"o{i}", 0) for i in range(7)]
    assert ctl.plan([("a", 4), *others], base_tokens=8)[0] > 0
    assert ctl.plan([("a", 4), *others], base_tokens=8, closed=True)[0] == 0
    assert ctl.plan([("b", 4), *others], base_tokens=8, closed=True)[0] == 4
    ctl.closed_min_gain = ctl.min_gain
    assert ctl.plan([("a", 4), *others], base_tokens=8, closed=True)[0] > 0


def test_plan_counts_the_draft_models_time():
    ctl = AdaptiveController(k_max=4, cost=_flat(), probe_every=0)
    for _ in range(20):
        ctl.observe("s", 4, 2)
    assert ctl.plan([("s", 4)], 1)[0] > 0
    slow = CostModel()
    slow.observe(1, 0.05)  # a draft step costs more than the target's
    ctl.draft_cost = slow
    assert ctl.plan([("s", 4)], 1) == [0]


def test_probe_and_shadow_update_a_switched_off_sequence():
    ctl = AdaptiveController(k_max=4, cost=_flat(0.02, 0.01), probe_every=3)
    for _ in range(30):
        ctl.observe("s", 4, 0)
    assert ctl.plan([("s", 4)], 1) == [0]  # no step time observed yet: no budget
    for _ in range(1000):  # 20 s of one-token steps: a budget of 0.4 s of probes
        ctl.observe_step(1, 0.02)
    plans = [ctl.plan([("s", 4)], 1)[0] for _ in range(6)]
    assert plans == [0, 1, 0, 0, 1, 0]
    ctl.probe_k = 0  # prompt lookup: the whole match
    assert [ctl.plan([("s", 3)], 1)[0] for _ in range(3)] == [0, 3, 0]
    before = ctl.acceptance("s")
    tokens = [5, 6, 7, 8, 9]
    ctl.set_shadow("s", [7, 8, 9], start=2)
    assert ctl.check_shadow("s", tokens[:3])  # not decided yet: one of three seen, equal
    assert ctl.acceptance("s") == before
    assert not ctl.check_shadow("s", tokens)
    assert ctl.acceptance("s") > before
    ctl.forget("s")
    assert ctl.acceptance("s") == ctl.global_acceptance


def test_acceptance_prior_is_pooled_per_group():
    """Keys (owner, group): a new key starts from its group's pooled rate (prompt lookup:
    the match length), other keys from the rate of all; the pooled rate of all moves
    with every key."""
    ctl = AdaptiveController(k_max=4, cost=_flat(0.02, 0.005), probe_every=0)
    for _ in range(40):
        ctl.observe(("a", 1), 4, 0)  # one-token matches: every proposal rejected
        ctl.observe(("a", 3), 4, 4)  # three-token matches: all accepted
    low, high = ctl.group_acceptance(1), ctl.group_acceptance(3)
    assert low < 0.1 and high > 0.9
    assert low < ctl.global_acceptance < high
    # a new sequence: its estimate per match length is its group's
    assert ctl.acceptance(("b", 1)) == pytest.approx(low)
    assert ctl.acceptance(("b", 3)) == pytest.approx(high)
    assert ctl.acceptance("b") == ctl.global_acceptance
    assert ctl.group_acceptance(2) == ctl.global_acceptance  # nothing seen in group 2
    # priced apart: the same sequence proposes after a long match, not after a short one
    assert ctl.plan([(("b", 3), 4)], 1)[0] > 0
    assert ctl.plan([(("b", 1), 4)], 1) == [0]
    ctl.forget(("a", 1))
    assert ctl.group_acceptance(1) == pytest.approx(low)  # the pool outlives its keys


def test_probes_are_rationed_by_the_budget():
    """At most one probe per step, and the cost curve's extra time of all probes stays
    within probe_budget of the observed step time."""
    cost = _flat(0.02, 0.01)  # every proposal adds half a one-token step: none pays
    ctl = AdaptiveController(k_max=4, cost=cost, probe_every=2, probe_k=0)
    seqs = [(f"s{i}", 3) for i in range(8)]
    for key, _ in seqs:
        for _ in range(30):
            ctl.observe(key, 4, 0)
    probes = spent = elapsed = 0.0
    for _ in range(400):
        ks = ctl.plan(seqs, base_tokens=8)
        assert sum(1 for k in ks if k) <= 1  # one probing sequence per step
        probes += sum(ks) > 0
        spent += cost(8 + sum(ks)) - cost(8)
        step = cost(8 + sum(ks))
        ctl.observe_step(8 + sum(ks), step)
        elapsed += step
        assert spent <= ctl.probe_budget * elapsed + 1e-12
    assert probes > 0  # probing did not stop for good
    assert spent / elapsed == pytest.approx(ctl.probe_budget, rel=0.25)


def test_nothing_to_propose_skips_pricing_but_counts_idle_steps():
    """Candidates that found nothing (caps 0) get k = 0 without the cost curve being
    consulted, and their idle steps still count towards a probe once they can propose."""

    class Counting(CostModel):
        calls = 0

        def __call__(self, tokens: int) -> float:
            Counting.calls += 1
            return super().__call__(tokens)

    cost = Counting()
    cost.seed(1, 0.01)
    cost.seed(2, 0.02)  # a proposal costs a whole step: only a probe proposes
    ctl = AdaptiveController(k_max=4, cost=cost, probe_every=5)
    for _ in range(60):  # steps enough that one probe fits the budget
        ctl.observe_step(1, 0.01)
    for _ in range(5):
        assert ctl.plan([("s", 0)], base_tokens=1) == [0]
    assert Counting.calls == 0
    assert ctl.plan([("s", 2)], base_tokens=1) == [1]  # due: five idle steps, a probe
    assert Counting.calls > 0


def test_spec_stats():
    st_ = SpecStats()
    st_.record(4, 4)
    st_.record(4, 1)
    st_.record(2, 0)
    st_.record(0, 0)
    d = st_.as_dict()
    assert d["proposals"] == 3 and d["proposed_tokens"] == 10 and d["accepted_tokens"] == 5
    assert d["skipped_steps"] == 1
    assert d["acceptance_per_position"] == [2 / 3, 1 / 2, 1.0, 1.0]
    assert d["mean_accepted_length"] == pytest.approx(8 / 3)
    total = SpecStats()
    total.add(st_)
    total.add(st_)
    assert total.as_dict()["accepted_tokens"] == 10
    with pytest.raises(ValueError):
        st_.record(1, 2)
