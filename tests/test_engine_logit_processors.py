"""``logit_bias`` and ``min_tokens``: the sampler against the reference of
``sampling_utils`` (numpy, float64), and the engine end to end (tiny model)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_utils import tiny, whole_pool
from hypothesis import given
from hypothesis import strategies as st
from sampling_utils import keys_for, ref_processed

from torch_topg.engine import Engine
from torch_topg.engine.errors import ParameterError
from torch_topg.engine.sampling import Sampler, SamplingParams, plain_greedy

GREEDY = dict(temperature=0, ignore_eos=True)


@st.composite
def rows(draw):
    B, V = draw(st.integers(1, 4)), draw(st.integers(2, 50))
    ids = st.integers(0, V - 1)
    bias = st.dictionaries(ids, st.sampled_from([-100.0, -3.5, 0.25, 2.0, 100.0]), max_size=4)
    params = [
        SamplingParams(
            temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
            top_k=draw(st.sampled_from([0, 5])),
            presence_penalty=draw(st.sampled_from([0.0, 0.5])),
            logit_bias=draw(bias) or None,
        )
        for _ in range(B)
    ]
    banned = [draw(st.lists(ids, max_size=3)) for _ in range(B)]
    outputs = [draw(st.lists(ids, max_size=5)) for _ in range(B)]
    return B, V, params, banned, outputs


@given(
    case=rows(), seed=st.integers(0, 2**16), dtype=st.sampled_from([torch.float32, torch.bfloat16])
)
def test_bias_and_bans_match_the_reference(case, seed, dtype):
    B, V, params, banned, outputs = case
    logits = (torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    before = logits.clone()
    s = Sampler()
    prompts = [[] for _ in range(B)]
    got = s.processed_probs(logits, params, prompts, outputs, banned).double().numpy()
    tokens = s(logits, params, *keys_for(B, seed), prompts, outputs, banned).tokens.tolist()
    raw = logits.float().double().numpy()
    for i, p in enumerate(params):
        x = ref_processed(raw[i], p, prompts[i], outputs[i], banned[i])
        if np.isneginf(x).all():  # every id banned: nothing to check against
            continue
        assert np.isfinite(x[tokens[i]])  # never a banned (or -inf) token
        if p.greedy:
            assert x[tokens[i]] == pytest.approx(x.max(), abs=1e-5)
            continue
        if p.top_k == 0:  # untruncated: the distribution itself, at the temperature
            want = np.exp((x - x.max()) / p.temperature)
            np.testing.assert_allclose(got[i], want / want.sum(), atol=2e-6, rtol=1e-4)
    assert torch.equal(logits, before)  # the input is never modified


def test_processors_leave_the_greedy_fast_path():
    assert plain_greedy([SamplingParams(temperature=0)])
    assert not plain_greedy([SamplingParams(temperature=0, logit_bias={3: 1.0})])
    assert not plain_greedy([SamplingParams(temperature=0, min_tokens=2)])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(logit_bias={3: 101}), "logit_bias"),
        (dict(logit_bias={-1: 1}), "logit_bias"),
        (dict(logit_bias={3: True}), "logit_bias"),
        (dict(logit_bias=[3]), "logit_bias"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(min_tokens=5, max_new_tokens=4), "min_tokens"),
    ],
)
def test_bad_values_are_refused_naming_them(kwargs, words):
    with pytest.raises(ParameterError, match=words) as e:
        SamplingParams.from_kwargs(**kwargs)
    assert e.value.param == words


def test_engine_bias_forces_and_min_tokens_defers_the_stop():
    p = list(range(3, 15))
    with Engine.from_model(tiny("llama-tiny"), block_size=4, compile=False) as eng, whole_pool(eng):
        free = eng.generate([p], max_new_tokens=6, **GREEDY)[0].token_ids
        forced = eng.generate([p], max_new_tokens=6, logit_bias={7: 100}, **GREEDY)[0]
        assert forced.token_ids == [7] * 6
        banned = eng.generate([p], max_new_tokens=6, logit_bias={free[0]: -100}, **GREEDY)[0]
        assert banned.token_ids[0] != free[0]
        # stop at the first greedy token, unless min_tokens defers it
        stop = dict(max_new_tokens=6, stop_token_ids=[free[0]], temperature=0)
        assert eng.generate([p], **stop)[0].token_ids == [free[0]]
        late = eng.generate([p], min_tokens=3, **stop)[0]
        assert len(late.token_ids) >= 3 and free[0] not in late.token_ids[:3]
        with pytest.raises(ParameterError, match="logit_bias"):
            eng.submit(p, logit_bias={10**6: 1.0})
