"""rotary_embedding against its reference and against Hugging Face's apply_rotary_pos_emb."""

from __future__ import annotations

import contextlib

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference


def make_cache(max_pos: int, rot_dim: int, dtype: torch.dtype, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim)
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


@requires_kernel("rotary_embedding")
@given(
    tokens=st.integers(1, 40),
    hq=st.integers(1, 6),
    hk=st.integers(0, 3),
    head_size=st.sampled_from([2, 6, 16, 64, 80, 128]),
    rot_frac=st.sampled_from([1.0, 0.5, 0.25]),
    is_neox=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    f32_cache=st.booleans(),
    split_heads=st.booleans(),
)
@example(1, 9, 3, 64, 1.0, True, torch.bfloat16, False, False)  # SmolLM2 decode
@example(7, 2, 1, 6, 1.0, False, torch.float32, True, True)
def test_rotary_embedding(
    tokens, hq, hk, head_size, rot_frac, is_neox, dtype, f32_cache, split_heads
):
    rot_dim = max(2, int(head_size * rot_frac) // 2 * 2)
    cache = make_cache(97, rot_dim, torch.float32 if f32_cache else dtype)
    positions = torch.randint(0, 97, (tokens,))
    shape_q = (tokens, hq, head_size) if split_heads else (tokens, hq * head_size)
    shape_k = (tokens, hk, head_size) if split_heads else (tokens, hk * head_size)
    q, k = torch.randn(shape_q, dtype=dtype), torch.randn(shape_k, dtype=dtype)
    key = k if hk else None
    q_ref, k_ref = q.clone(), k.clone()
    torch_topg.ops.rotary_embedding(positions, q, key, head_size, cache, is_neox)
    reference.rotary_embedding(positions, q_ref, k_ref if hk else None, head_size, cache, is_neox)
    assert_close(q, q_ref)
    assert_close(k, k_ref)


@requires_kernel("rotary_embedding")
def test_rotary_on_fused_qkv_slice_and_batched_positions():
    b, s, hq, hk, d = 2, 5, 4, 2, 32
    qkv = torch.randn(b, s, (hq + 2 * hk) * d)
    q, k = qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d]  # strided views
    positions = torch.arange(s).expand(b, s).contiguous()
    cache = make_cache(16, d, torch.float32)
    expected = qkv.clone()
    reference.rotary_embedding(
        positions, expected[..., : hq * d], expected[..., hq * d : (hq + hk) * d], d, cache, True
    )
    torch_topg.ops.rotary_embedding(positions, q, k, d, cache, True)
    assert_close(qkv, expected)


def test_reference_matches_hugging_face():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    t, h, d = 6, 3, 16
    cache = make_cache(32, d, torch.float32)
    positions = torch.tensor([0, 3, 5, 9, 30, 31])
    q, k = torch.randn(t, h, d), torch.randn(t, h, d)
    cos, sin = cache[positions].chunk(2, -1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    reference.rotary_embedding(positions, q, k, d, cache, True)
    torch.testing.assert_close(q, q_hf[0].transpose(0, 1))
    torch.testing.assert_close(k, k_hf[0].transpose(0, 1))


def test_rotary_opcheck_and_compile():
    positions = torch.randint(0, 64, (5,))
    cache = make_cache(64, 16, torch.float32)
    q, k = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16)
    torch.library.opcheck(
        torch.ops.topg.rotary_embedding.default, (positions, q, k, 16, cache, True)
    )

    def f(p, q, k):
        torch_topg.ops.rotary_embedding(p, q, k, 16, cache, False)
        return q * 2, k

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(positions, q.clone(), k.clone())
    expected = f(positions, q.clone(), k.clone())
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (
            lambda a: a.update(positions=a["positions"].float()),
            "argument 'positions'.*int32 or int64",
        ),
        (
            lambda a: a.update(positions=torch.tensor([0, 1, 2, 99])),
            "argument 'positions'.*values in",
        ),
        (lambda a: a.update(query=torch.randn(4, 30)), "argument 'query'.*multiple of head_size"),
        (lambda a: a.update(key=torch.randn(4, 16).half()), "argument 'key'.*dtype float32"),
        (
            lambda a: a.update(
                cos_sin_cache=make_cache(8, 16, torch.float32)[:, :6].contiguous()[:, :5]
            ),
            "argument 'cos_sin_cache'",
        ),
        (lambda a: a.update(query=torch.randn(3, 16)), "argument 'query'.*size 4 at dim 0"),
    ],
)
def test_rotary_bad_input(mutate, match):
    args = dict(
        positions=torch.tensor([0, 1, 2, 3]),
        query=torch.randn(4, 32),
        key=torch.randn(4, 16),
        head_size=8,
        cos_sin_cache=make_cache(8, 8, torch.float32),
        is_neox=True,
    )
    mutate(args)
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.rotary_embedding(**args)


def test_rotary_rejects_query_that_cannot_be_updated_in_place():
    # Token dims [2, 2] that do not collapse to one stride: native and fake paths refuse.
    for mode in (contextlib.nullcontext(), torch._subclasses.FakeTensorMode()):
        with mode, pytest.raises(RuntimeError, match="argument 'query'.*in place"):
            q = torch.empty(2, 2, 64).transpose(0, 1)
            positions = torch.zeros(2, 2, dtype=torch.long)
            torch_topg.ops.rotary_embedding(positions, q, None, 32, torch.empty(8, 32), True)
