"""torch_topg.engine.sampling: parameters, keyed draws, distributions, penalties, logprobs.

The target distributions are computed here independently (numpy, float64) from the rules
the module documents (vLLM's order: penalties, temperature, min-p, top-k, top-p).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from torch_topg.engine.keyed import mix64
from torch_topg.engine.sampling import (
    MAX_LOGPROBS,
    SALT_ACCEPT,
    SALT_RESIDUAL,
    SALT_SAMPLE,
    Sampler,
    SamplingParams,
    keyed_gumbel,
    keyed_uniform,
    sample_from_probs,
    seed_tensor,
)

SP = SamplingParams


def _logits(B: int, V: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, V, generator=g) * scale


def _keys(B: int, seed: int = 1234, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.full((B,), seed, dtype=torch.int64), torch.arange(start, start + B)


# --------------------------------------------------------------------------- reference


def ref_penalised(
    logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]
) -> np.ndarray:
    """vLLM's penalties, one row, written out plainly."""
    x = logits.astype(np.float64).copy()
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        c = output.count(t)
        x[t] -= p.frequency_penalty * c + p.presence_penalty
    return x


def ref_probs(x: np.ndarray, p: SamplingParams) -> tuple[np.ndarray, float]:
    """The final distribution of one (penalised) row, and the smallest relative margin of
    any keep/drop decision (to skip cases that rounding could decide either way)."""
    V = x.shape[0]
    if p.greedy:
        out = np.zeros(V)
        out[int(np.argmax(x))] = 1.0
        return out, math.inf
    z = x / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = np.ones(V, dtype=bool)
    margin = math.inf
    if p.min_p > 0:
        thr = p.min_p * probs.max()
        keep &= probs >= thr
        margin = min(margin, np.min(np.abs(probs - thr)) / probs.max())
    if 0 < p.top_k < V:
        masked = np.where(keep, z, -np.inf)
        kth = np.sort(masked)[::-1][p.top_k - 1]
        keep &= masked >= kth
    if p.top_p < 1:
        q = np.where(keep, probs, 0.0)
        q /= q.sum()
        order = np.argsort(-np.where(keep, z, -np.inf), kind="stable")
        before = np.cumsum(q[order]) - q[order]
        n_keep = max(int(np.sum(before < p.top_p)), 1)
        cut = z[order[n_keep - 1]]
        keep &= z >= cut
        live = before[q[order] > 0]
        margin = min(margin, float(np.min(np.abs(live - p.top_p))))
    out = np.where(keep, probs, 0.0)
    return out / out.sum(), margin


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (support only)."""
    n = counts.sum()
    sup = probs > 0
    assert counts[~sup].sum() == 0, f"drew tokens outside the support: {counts}, {probs}"
    exp = n * probs[sup]
    assert exp.min() >= 5, "test set-up: an expected count below 5"
    stat = float(((counts[sup] - exp) ** 2 / exp).sum())
    df = int(sup.sum()) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


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


# --------------------------------------------------------------------------- keyed randomness


def _splitmix64_py(x: int) -> int:
    m = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & m
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_mix64_matches_splitmix64():
    xs = [0, 1, 2, 12345, (1 << 63) - 1, -1, -(1 << 63), 0xDEADBEEF]
    got = mix64(torch.tensor(xs, dtype=torch.int64)).tolist()
    want = [_splitmix64_py(x & ((1 << 64) - 1)) for x in xs]
    assert [g & ((1 << 64) - 1) for g in got] == want


def _row_key_py(seed: int, position: int, salt: int) -> int:
    m = (1 << 64) - 1
    k = _splitmix64_py((seed ^ (salt * 0xD1B54A32D192ED03)) & m)
    return _splitmix64_py(k ^ (position & m))


def _gumbel_py(seed: int, position: int, salt: int, v: int) -> float:
    """The documented per-token noise, in plain Python: lowbias32 of (id * golden) ^ key."""
    m32 = 0xFFFFFFFF
    h = ((v * 0x9E3779B9) & m32) ^ (_row_key_py(seed, position, salt) & m32)
    h ^= h >> 16
    h = (h * 0x7FEB352D) & m32
    h ^= h >> 15
    h = (h * 0x846CA68B) & m32
    h ^= h >> 16
    w = ((h & 0x7FFFFFFF) + 0.5) / 2**31
    return -math.log(-math.log1p(-w))


def test_keyed_noise_matches_plain_python():
    # pins the hash: draws stay reproducible across versions, CPU and CUDA (int32 / int64
    # wrap-around, logical shifts emulated on torch's arithmetic ones)
    seeds = [0, 1, -7, 2**63 - 1, 123456789]
    positions = [0, 5, 100000, 3, 2**40]
    got = keyed_gumbel(torch.tensor(seeds), torch.tensor(positions), 64, salt=SALT_SAMPLE)
    for i, (sd, ps) in enumerate(zip(seeds, positions, strict=True)):
        want = [_gumbel_py(sd & ((1 << 64) - 1), ps, SALT_SAMPLE, v) for v in range(64)]
        np.testing.assert_allclose(got[i].double().numpy(), want, atol=1e-3, rtol=1e-5)
    u = keyed_uniform(torch.tensor(seeds), torch.tensor(positions), salt=SALT_ACCEPT)
    want_u = [
        ((_row_key_py(sd & ((1 << 64) - 1), ps, SALT_ACCEPT) >> 41) + 0.5) / 2**23
        for sd, ps in zip(seeds, positions, strict=True)
    ]
    assert u.double().tolist() == want_u


def test_seed_tensor_wraps_python_ints():
    t = seed_tensor([0, -1, 1 << 63, (1 << 64) + 5])
    assert t.dtype == torch.int64
    assert t.tolist() == [0, -1, -(1 << 63), 5]


def test_keyed_uniform():
    n = 20000
    seeds, pos = _keys(n, seed=7)
    u = keyed_uniform(seeds, pos)
    assert u.dtype == torch.float32 and u.shape == (n,)
    assert (u > 0).all() and (u < 1).all()
    assert torch.equal(u, keyed_uniform(seeds, pos))  # reproducible
    assert torch.equal(u, Sampler.uniform(seeds.tolist(), pos.tolist(), SALT_ACCEPT))
    assert not torch.equal(u, keyed_uniform(seeds, pos, salt=SALT_RESIDUAL))
    counts = np.bincount((u.numpy() * 20).astype(int), minlength=20)
    assert chi2_pvalue(counts, np.full(20, 1 / 20)) > 1e-4
    # adjacent seeds (the engine gives sample i of a request seed + i) are independent
    v = keyed_uniform(seeds + 1, pos)
    assert abs(np.corrcoef(u.numpy(), v.numpy())[0, 1]) < 5 / math.sqrt(n)


def test_keyed_gumbel_is_standard_gumbel():
    n = 20000
    g = keyed_gumbel(*_keys(n, seed=3), 4)  # [n, 4]
    assert g.shape == (n, 4) and torch.isfinite(g).all()
    # mean: Euler-Mascheroni, variance pi^2 / 6; the 4 columns uncorrelated
    assert abs(g.mean().item() - 0.5772) < 0.03
    assert abs(g.var().item() - math.pi**2 / 6) < 0.08
    c = np.corrcoef(g.numpy().T)
    assert np.abs(c - np.eye(4)).max() < 5 / math.sqrt(n)
    ids = torch.tensor([[3, 0], [1, 2]])
    sub = keyed_gumbel(*_keys(2, seed=3), ids)
    assert torch.equal(sub, g[:2].gather(1, ids))  # keyed by id, not by column


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


# --------------------------------------------------------------------------- keyed draws

MIXED = [
    SP(),
    SP(temperature=0.7, top_k=5),
    SP(temperature=1.3, top_p=0.8),
    SP(min_p=0.1),
    SP(temperature=0),
    SP(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
    SP(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2),
    SP(temperature=1.1, logprobs=3, top_p=0.95),
]


@given(
    row=st.integers(0, len(MIXED) - 1),
    mates=st.lists(st.integers(0, len(MIXED) - 1), min_size=4, max_size=4),
    perm=st.permutations(range(5)),
    seed=st.integers(0, 2**62),
    position=st.integers(0, 100000),
)
@example(row=0, mates=[1, 2, 3, 4], perm=[4, 3, 2, 1, 0], seed=1, position=0)
def test_draw_independent_of_batch_mates_and_order(row, mates, perm, seed, position):
    V = 257
    g = torch.Generator().manual_seed(seed % 1000)
    logits = torch.randn(5, V, generator=g) * 2
    prompts = [torch.randint(0, V, (9,), generator=g).tolist() for _ in range(5)]
    outputs = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(5)]
    params = [MIXED[row]] + [MIXED[m] for m in mates]
    seeds = torch.tensor([seed] + [seed + 1 + i for i in range(4)])  # row 0 is the probe
    positions = torch.tensor([position] + [position + 3 * i for i in range(4)])
    s = Sampler()
    alone = s(logits[:1], params[:1], seeds[:1], positions[:1], prompts[:1], outputs[:1])
    p = list(perm)
    batch = s(
        logits[p],
        [params[i] for i in p],
        seeds[p],
        positions[p],
        [prompts[i] for i in p],
        [outputs[i] for i in p],
    )
    j = p.index(0)
    assert batch.tokens[j] == alone.tokens[0]
    if params[0].logprobs is not None:
        assert torch.equal(batch.logprobs[j], alone.logprobs[0])
    again = s(logits[:1], params[:1], seeds[:1], positions[:1], prompts[:1], outputs[:1])
    assert torch.equal(again.tokens, alone.tokens)


@pytest.mark.parametrize("params", [SP(), SP(top_k=500), SP(top_p=0.99), SP(min_p=1e-4)], ids=str)
def test_different_keys_give_different_draws(params):
    V, n = 1000, 200
    logits = torch.zeros(n, V)  # uniform: every key should land somewhere else
    s = Sampler()
    by_pos = s(logits, [params] * n, *_keys(n, seed=99)).tokens
    by_seed = s(logits, [params] * n, torch.arange(n), torch.full((n,), 17)).tokens
    # 200 uniform draws from 1000 have ~181 distinct values
    assert len(set(by_pos.tolist())) > 150
    assert len(set(by_seed.tolist())) > 150
    assert (by_pos != by_seed).sum() > 150


def test_adjacent_seeds_are_independent():
    # V=2, even odds: two sequences seeded s and s+1 agree half the time
    n = 4000
    logits = torch.zeros(n, 2)
    s = Sampler()
    a = s(logits, [SP()] * n, *_keys(n, seed=500)).tokens
    b = s(logits, [SP()] * n, *_keys(n, seed=501)).tokens
    c = s(logits, [SP()] * n, *_keys(n, seed=500, start=1)).tokens  # next position
    for other in (b, c):
        agree = (a == other).sum().item()
        assert abs(agree - n / 2) < 5 * math.sqrt(n / 4)


def test_full_and_candidate_paths_share_the_noise():
    # A min_p that drops nothing sends the rows down the candidate path; the draw is the
    # same as the full-vocabulary race because the noise is keyed by token id.
    B, V = 64, 500
    logits = _logits(B, V, 5, scale=1.0)
    s = Sampler()
    full = s(logits, [SP(temperature=0.9)] * B, *_keys(B)).tokens
    cand = s(logits, [SP(temperature=0.9, min_p=1e-30)] * B, *_keys(B)).tokens
    assert torch.equal(full, cand)


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
