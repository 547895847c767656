"""torch_topg.engine.sampling: parameters, greedy, distributions, truncation, penalties,
logprobs and input checks, against the independent references of ``sampling_utils``
(numpy, float64). The keyed randomness is tested in ``test_engine_sampling_keyed.py``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from sampling_utils import MIXED, chi2_pvalue, ref_penalised, ref_probs
from sampling_utils import keys_for as _keys
from sampling_utils import logits_for as _logits
from torch.overrides import TorchFunctionMode

from torch_topg.engine.sampling import (
    MAX_LOGPROBS,
    SALT_SAMPLE,
    Sampler,
    SamplingParams,
    sample_from_probs,
)

SP = SamplingParams


# --------------------------------------------------------------------------- parameters

BAD = [
    ("temperature", -0.5),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", -0.1),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.1),
    ("min_p", 1.01),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3.0),
    ("frequency_penalty", -2.5),
    ("n", 0),
    ("max_new_tokens", -1),
    ("max_length", 0),
    ("logprobs", -1),
    ("logprobs", MAX_LOGPROBS + 1),
    ("stop_token_ids", ["7"]),
    ("stop_token_ids", [1.5]),
    ("stop_token_ids", [-3]),
    ("stop", [3]),
    ("stop", ["ok", ""]),
    ("seed", 1.5),
]


@pytest.mark.parametrize(("name", "value"), BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_validate_names_the_parameter(name, value):
    params = SP(**{name: value})
    with pytest.raises(ValueError, match=name) as e:
        params.validate()
    assert repr(value) in str(e.value)
    with pytest.raises(ValueError, match=name):
        SP.from_kwargs(**{name: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0.0},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"logprobs": 0},
        {"logprobs": MAX_LOGPROBS},
        {"max_new_tokens": 0, "max_length": 1, "n": 3, "seed": -5},
        {"stop": ["a", "b"], "stop_token_ids": [0, 2], "ignore_eos": True},
    ],
)
def test_validate_accepts_edges(kwargs):
    SP.from_kwargs(**kwargs).validate()


def test_stop_string_is_wrapped():
    assert SP(stop="###").stop == ["###"]
    assert SP.from_kwargs(stop="x", stop_token_ids=(1, 2)).stop_token_ids == [1, 2]
    assert SP().stop == [] and SP().stop_token_ids == []


def test_unknown_keyword_rejected():
    with pytest.raises(ValueError, match="max_tokens") as e:
        SP.from_kwargs(max_tokens=5, temperature=0.5)
    msg = str(e.value)
    for name in ("max_new_tokens", "top_p", "logprobs", "stop_token_ids"):
        assert name in msg  # the accepted ones are listed


def test_greedy_property():
    assert SP(temperature=0).greedy
    assert SP(temperature=1e-6).greedy  # vLLM: below 1e-5 is greedy
    assert not SP(temperature=1e-5).greedy
    assert not SP().greedy


# --------------------------------------------------------------------------- greedy


@given(
    B=st.integers(1, 6),
    V=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_greedy_is_argmax(B, V, dtype, seed):
    logits = _logits(B, V, seed).to(dtype)
    out = Sampler()(logits, [SP(temperature=0)] * B, *_keys(B, seed))
    assert torch.equal(out.tokens, logits.float().argmax(-1))
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_ties_take_lowest_id():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [7.0, 7.0, 7.0, 7.0], [0.0, -1.0, 3.0, 3.0]])
    s = Sampler()
    assert s(logits, [SP(temperature=0)] * 3, *_keys(3)).tokens.tolist() == [1, 0, 2]
    # the same through the general path (penalties that change nothing, logprobs)
    ps = [SP(temperature=0, presence_penalty=0.5, logprobs=1)] * 3
    out = s(logits, ps, *_keys(3), [[]] * 3, [[]] * 3)
    assert out.tokens.tolist() == [1, 0, 2]
    # vocabulary-sized rows with many exact ties (the CPU path reduces with max, not
    # argmax): the lowest id of the maxima, as torch.argmax; a NaN counts as the largest
    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, 4, (6, 49157), generator=g).float()
    long[4, 40000] = float("nan")
    long[5, 123] = long[5, 45000] = float("inf")
    expect = torch.tensor([int(r.argmax()) for r in long])
    assert torch.equal(s(long, [SP(temperature=0)] * 6, *_keys(6)).tokens, expect)
    assert expect[4] == 40000 and expect[5] == 123


class _Calls(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_greedy_fast_path_is_one_reduction():
    """Greedy rows cost one row-wise reduction (on the CPU max's indices, which are
    argmax's and 2.4x faster there): no copy, no noise."""
    logits = _logits(16, 1000)
    seeds, pos = _keys(16)
    with _Calls() as calls:
        out = Sampler()(logits, [SP(temperature=0)] * 16, seeds, pos)
    metadata = {"__get__", "dim", "is_floating_point", "to", "size"}
    assert calls.names - metadata == {"max"}, calls.names
    assert torch.equal(out.tokens, logits.argmax(-1))


# --------------------------------------------------------------------------- distributions

BASE = np.array([2.0, 1.0, 0.5, 0.0, -0.5, 1.4, 1.6, 0.3])


@pytest.mark.parametrize(
    "params",
    [
        SP(temperature=0.8),
        SP(temperature=1.5),
        SP(top_k=3),
        SP(temperature=1.2, top_k=6),
        SP(top_p=0.7),
        SP(temperature=2.0, top_p=0.5),
        SP(min_p=0.25),
        SP(top_p=0.6, min_p=0.3),  # top-p's mass is over the min-p survivors
        SP(temperature=1.3, top_k=6, top_p=0.85, min_p=0.1),
    ],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}",
)
def test_sampled_distribution_matches_target(params):
    n = 4000
    target, margin = ref_probs(BASE, params)
    assert margin > 1e-3  # the set-up keeps away from boundaries
    logits = torch.tensor(BASE, dtype=torch.float32).expand(n, -1)
    s = Sampler()
    tokens = s(logits, [params] * n, *_keys(n, seed=2024)).tokens
    counts = np.bincount(tokens.numpy(), minlength=len(BASE))
    assert chi2_pvalue(counts, target) > 1e-4, (counts, target * n)
    # the same target through the sampler's own distribution
    probs = s.processed_probs(logits[:1], [params]).double().numpy()[0]
    np.testing.assert_allclose(probs, target, atol=1e-6)
    # seeds as the key (one position) follow the target too
    tokens = s(logits, [params] * n, torch.arange(n), torch.full((n,), 11)).tokens
    counts = np.bincount(tokens.numpy(), minlength=len(BASE))
    assert chi2_pvalue(counts, target) > 1e-4, (counts, target * n)


def test_sample_from_probs_distribution():
    n = 4000
    probs = torch.tensor([0.1, 0.0, 0.35, 0.05, 0.0, 0.5])
    tokens = sample_from_probs(probs.expand(n, -1) * 3.0, *_keys(n, seed=8))  # unnormalised
    counts = np.bincount(tokens.numpy(), minlength=6)
    assert chi2_pvalue(counts, probs.double().numpy()) > 1e-4


@given(cfg=st.sampled_from(MIXED), seed=st.integers(0, 1000))
def test_sample_from_processed_probs_reproduces_the_draw(cfg, seed):
    B, V = 8, 300
    logits = _logits(B, V, seed)
    outs = [list(range(seed % 7, seed % 7 + 5))] * B
    seeds, pos = _keys(B, seed=seed)
    s = Sampler()
    drawn = s(logits, [cfg] * B, seeds, pos, outs, outs).tokens
    probs = s.processed_probs(logits, [cfg] * B, outs, outs)
    assert torch.allclose(probs.sum(-1), torch.ones(B))
    again = sample_from_probs(probs, seeds, pos, SALT_SAMPLE)
    assert torch.equal(drawn, again)


# --------------------------------------------------------------------------- truncation


@st.composite
def trunc_params(draw):
    return SP(
        temperature=draw(st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.8])),
        top_k=draw(st.sampled_from([-1, 0, 1, 2, 5, 17, 400])),
        top_p=draw(st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.2, 1e-6])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.5, 1.0])),
    )


@given(
    params=st.lists(trunc_params(), min_size=1, max_size=5),
    V=st.integers(2, 300),
    seed=st.integers(0, 2**16),
    quantise=st.booleans(),
)
@example(params=[SP(top_k=400)], V=10, seed=0, quantise=False)
def test_processed_probs_match_reference(params, V, seed, quantise):
    B = len(params)
    logits = _logits(B, V, seed, scale=4.0)
    if quantise:  # many exact ties
        logits = logits.round()
    refs = [ref_probs(logits[i].double().numpy(), params[i]) for i in range(B)]
    assume(all(m > 1e-4 for _, m in refs))
    got = Sampler().processed_probs(logits, params).double().numpy()
    for i in range(B):
        np.testing.assert_allclose(got[i], refs[i][0], atol=2e-6, err_msg=str(params[i]))


def test_truncation_edges():
    s = Sampler()
    x = torch.tensor([[3.0, 2.0, 2.0, 2.0, 1.0, 0.0]])
    plain = s.processed_probs(x, [SP()])
    torch.testing.assert_close(plain, x.softmax(-1))
    for p in (SP(top_k=6), SP(top_k=100), SP(top_k=-1), SP(top_p=1.0), SP(min_p=0.0)):
        torch.testing.assert_close(s.processed_probs(x, [p]), plain)
    # top-k ties with the k-th value are all kept
    k2 = s.processed_probs(x, [SP(top_k=2)])[0]
    assert (k2[:4] > 0).all() and (k2[4:] == 0).all()
    # a top-p so small only the argmax survives; then sampling is deterministic
    tiny = SP(top_p=1e-6)
    assert s.processed_probs(x, [tiny])[0].tolist() == [1.0, 0, 0, 0, 0, 0]
    n = 50
    assert (s(x.expand(n, -1), [tiny] * n, *_keys(n)).tokens == 0).all()
    # top-p ties with the last survivor are all kept: 3 alone is < 0.5 of the mass
    mass3 = x.softmax(-1)[0, 0].item()
    assert mass3 < 0.5
    p5 = s.processed_probs(x, [SP(top_p=0.5)])[0]
    assert (p5[:4] > 0).all() and (p5[4:] == 0).all()
    # min-p just above and just below the threshold (0.2 of the max probability)
    m = torch.tensor([[0.0, math.log(0.2) + 1e-3, math.log(0.2) - 1e-3]])
    assert (s.processed_probs(m, [SP(min_p=0.2)])[0] > 0).tolist() == [True, True, False]
    # top-k counts from the top, after temperature (which keeps the order)
    assert (s.processed_probs(m, [SP(top_k=1, temperature=5.0)])[0] > 0).tolist() == [
        True,
        False,
        False,
    ]
    # min_p = 1 keeps the (tied) maxima only
    y = torch.tensor([[1.0, 4.0, 4.0, 0.0]])
    assert s.processed_probs(y, [SP(min_p=1.0)])[0].tolist() == [0, 0.5, 0.5, 0]
    # -inf logits (masked by the caller) are never drawn
    z = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")]]).expand(200, -1)
    for p in (SP(), SP(top_k=3), SP(top_p=0.9), SP(min_p=0.5)):
        t = s(z, [p] * 200, *_keys(200)).tokens
        assert set(t.tolist()) == {0, 2}


def test_large_vocab_candidates():
    # Peaked rows (real-LLM-like): top-p works on a candidate subset, must still be exact.
    B, V = 6, 20000
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, V, generator=g) * 2.5
    logits[:, :40] += 6.0
    ps = [SP(top_p=0.9), SP(top_p=0.95, temperature=0.7), SP(top_k=50, top_p=0.8)] * 2
    got = Sampler().processed_probs(logits, ps).double().numpy()
    for i in range(B):
        want, margin = ref_probs(logits[i].double().numpy(), ps[i])
        assert margin > 1e-6
        np.testing.assert_allclose(got[i], want, atol=1e-6)


# --------------------------------------------------------------------------- penalties


@given(
    B=st.integers(1, 5),
    V=st.integers(2, 60),
    seed=st.integers(0, 2**16),
    rep=st.sampled_from([1.0, 0.5, 1.3, 2.0]),
    pres=st.sampled_from([0.0, -0.7, 0.5, 2.0]),
    freq=st.sampled_from([0.0, 0.3, -1.0]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_penalties_match_reference(B, V, seed, rep, pres, freq, dtype):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 2).to(dtype)
    before = logits.clone()
    prompts = [
        torch.randint(0, V, (int(torch.randint(0, 8, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]
    outputs = [
        torch.randint(0, V, (int(torch.randint(0, 12, (1,), generator=g)),), generator=g).tolist()
        for _ in range(B)
    ]
    pen = SP(repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    # every other row without penalties: the batch mixes both
    params = [pen if i % 2 == 0 else SP() for i in range(B)]
    s = Sampler()
    got = s.processed_probs(logits, params, prompts, outputs).double().numpy()
    raw = logits.float().double().numpy()
    for i in range(B):
        x = ref_penalised(raw[i], params[i], prompts[i], outputs[i])
        want = np.exp(x - x.max())
        np.testing.assert_allclose(got[i], want / want.sum(), atol=2e-6, rtol=1e-4)
    # greedy takes the argmax of the penalised logits
    gp = [
        SP(temperature=0, repetition_penalty=rep, presence_penalty=pres, frequency_penalty=freq)
    ] * B
    tok = s(logits, gp, *_keys(B), prompts, outputs).tokens.tolist()
    for i in range(B):
        x = ref_penalised(raw[i], gp[i], prompts[i], outputs[i])
        assert x[tok[i]] == pytest.approx(x.max(), abs=1e-5)
    assert torch.equal(logits, before)  # the input is never modified


def test_penalties_ignore_out_of_range_ids_and_accept_tensors():
    logits = torch.tensor([[1.0, -1.0, 2.0]])
    p = SP(repetition_penalty=2.0, presence_penalty=0.5)
    s = Sampler()
    a = s.processed_probs(logits, [p], [[0, 7, -1]], [torch.tensor([1, 99])])
    x = torch.tensor([0.5 - 0.0, -2.0 - 0.5, 2.0])
    torch.testing.assert_close(a, x.softmax(-1).unsqueeze(0))


def test_penalties_need_token_lists():
    logits = torch.zeros(2, 5)
    s = Sampler()
    with pytest.raises(ValueError, match="output_tokens"):
        s(logits, [SP(presence_penalty=1.0), SP()], *_keys(2))
    with pytest.raises(ValueError, match="prompt_tokens"):
        s(logits, [SP(repetition_penalty=1.2)] * 2, *_keys(2), None, [[], []])
    # presence/frequency alone read only the outputs
    s(logits, [SP(frequency_penalty=1.0)] * 2, *_keys(2), None, [[1], [2]])


# --------------------------------------------------------------------------- logprobs


@given(seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_logprobs_are_raw_log_softmax(seed, dtype):
    B, V = 6, 120
    logits = _logits(B, V, seed).to(dtype)
    ks = [None, 0, 3, MAX_LOGPROBS, None, 1]
    params = [
        SP(temperature=0.7, top_k=10, logprobs=k, repetition_penalty=1.5)
        if i % 2
        else SP(temperature=0, logprobs=k, presence_penalty=1.0)
        for i, k in enumerate(ks)
    ]
    outs = [[1, 2, 3]] * B
    out = Sampler()(logits, params, *_keys(B, seed), outs, outs)
    ref = torch.log_softmax(logits.float(), -1)  # raw: before penalties and temperature
    vals, ids = out.top_logprobs
    assert vals.shape == ids.shape == (B, MAX_LOGPROBS)
    for i, k in enumerate(ks):
        if k is None:
            assert torch.isnan(out.logprobs[i])
            assert (ids[i] == -1).all() and torch.isneginf(vals[i]).all()
            continue
        torch.testing.assert_close(out.logprobs[i], ref[i, out.tokens[i]])
        want_v, _ = ref[i].topk(k)
        torch.testing.assert_close(vals[i, :k], want_v)
        torch.testing.assert_close(ref[i, ids[i, :k]], want_v)  # ids (ties in any order)
        assert (ids[i, k:] == -1).all() and torch.isneginf(vals[i, k:]).all()


def test_no_logprobs_asked():
    out = Sampler()(_logits(3, 10), [SP()] * 3, *_keys(3))
    assert out.logprobs is None and out.top_logprobs is None
    assert out.tokens.dtype == torch.int64 and out.tokens.shape == (3,)


# --------------------------------------------------------------------------- inputs


def test_input_checks():
    s = Sampler()
    with pytest.raises(ValueError, match="SamplingParams"):
        s(torch.zeros(2, 4), [SP()], *_keys(2))
    with pytest.raises(ValueError, match="seeds and positions"):
        s(torch.zeros(2, 4), [SP()] * 2, *_keys(3))
    with pytest.raises(ValueError, match="logits"):
        s(torch.zeros(4), [SP()], *_keys(1))
    out = s(torch.zeros(2, 4), [SP()] * 2, [1, 2**64 - 1], [0, 5])  # Python ints work
    assert out.tokens.shape == (2,)
