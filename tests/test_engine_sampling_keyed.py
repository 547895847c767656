"""torch_topg.engine.sampling's keyed randomness: the noise equals a plain-Python
splitmix64 of (seed, position, salt, token), and a draw depends only on its own row's
key, not on its batch-mates, their order, or the path (full vocabulary or candidates)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from sampling_utils import MIXED, chi2_pvalue
from sampling_utils import keys_for as _keys
from sampling_utils import logits_for as _logits

from torch_topg.engine.keyed import mix64
from torch_topg.engine.sampling import (
    SALT_ACCEPT,
    SALT_RESIDUAL,
    SALT_SAMPLE,
    Sampler,
    keyed_gumbel,
    keyed_uniform,
    seed_tensor,
)
from torch_topg.engine.sampling import SamplingParams as SP

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


# --------------------------------------------------------------------------- keyed draws


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
