"""Speculative decoding units (torch_topg.engine.speculative): the ``speculative=``
config, prompt-lookup proposals, the verification rules (exact for greedy; for
sampling the distribution of the first two tokens equals the plain sampler's, by
chi-square, for a draft that agrees with the target and one that does not) and the
statistics. The adaptive rule is tested in ``test_speculative_adaptive.py``, the engine
integration in ``test_speculative_engine.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torch_topg.engine.sampling import (
    Sampler,
    SamplingParams,
    joined_rows,
    rows_of,
    sample_from_probs,
    seed_tensor,
)
from torch_topg.engine.speculative import (
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


# --------------------------------------------------------------------------- stats


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
