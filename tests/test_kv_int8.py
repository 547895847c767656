"""The int8 KV cache: ``reshape_and_cache`` and ``paged_attention`` with ``key_scale`` /
``value_scale`` against their references (``reference.quantize_kv`` defines the
quantisation), and the error of int8 KV against the float cache it was made from."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference
from torch_topg.reference import dequantize_kv, quantize_kv

HEADS = [(1, 1), (4, 4), (4, 2), (8, 2), (9, 3), (32, 8), (6, 1), (3, 1)]


def _cu(q_lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)


def _int8_paged(lens, hq, hkv, d, block_size, dtype, q_rows=None):
    """(q, float caches, int8 caches + scales, block_tables, seq_lens): the int8 caches
    hold the float caches quantised (some all-zero rows: scale 0)."""
    max_blocks = max(1, max(-(-n // block_size) for n in lens)) + 1
    num_blocks = len(lens) * max_blocks + 3
    kf = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    vf = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype) * 2
    kf[0, 0], vf[-1, -1] = 0, 0
    (kq, ks), (vq, vs) = quantize_kv(kf), quantize_kv(vf)
    bt = torch.randperm(num_blocks)[: len(lens) * max_blocks].view(len(lens), max_blocks).int()
    q = torch.randn(len(lens) if q_rows is None else q_rows, hq, d, dtype=dtype)
    return q, (kf, vf), (kq, vq, ks, vs), bt, torch.tensor(lens, dtype=torch.int32)


def test_quantize_kv_semantics():
    x = torch.randn(5, 3, 64) * torch.tensor([1e-3, 1.0, 50.0])[:, None]
    q, s = quantize_kv(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (5, 3)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(s, x.abs().amax(-1) / 127)
    err = (dequantize_kv(q, s) - x).abs()
    assert bool((err <= s[..., None] * 0.5001).all())  # half a step at most
    zero, _ = quantize_kv(torch.zeros(2, 8))
    assert torch.equal(zero, torch.zeros(2, 8, dtype=torch.int8))
    assert torch.equal(dequantize_kv(*quantize_kv(torch.zeros(2, 8))), torch.zeros(2, 8))
    # round half to even: x / scale = 0.5 and 1.5 (scale 1 from max|x| = 127)
    halves = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5]])
    assert quantize_kv(halves)[0].tolist() == [[127, 0, 2, 2, 0, -2]]
    # a non-finite row reads back as NaN; the other rows are untouched
    bad = torch.randn(3, 16)
    bad[0, 3], bad[1, 0] = float("nan"), float("inf")
    d = dequantize_kv(*quantize_kv(bad))
    assert bool(d[:2].isnan().all()) and bool(d[2].isfinite().all())
    # bf16 / fp16 inputs: the same as their fp32 values
    h = torch.randn(4, 32).bfloat16()
    assert all(
        torch.equal(a, b) for a, b in zip(quantize_kv(h), quantize_kv(h.float()), strict=True)
    )


@requires_kernel("reshape_and_cache")
@given(
    tokens=st.integers(0, 40),
    heads_dim=st.sampled_from([(1, 32), (3, 64), (8, 128), (3, 20), (2, 7)]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from([torch.int64, torch.int32]),
    pad=st.booleans(),
    transposed=st.booleans(),
    magnitude=st.sampled_from([1.0, 1e-30, 1e4]),
)
@example(17, (8, 128), 16, torch.bfloat16, torch.int64, True, True, 1.0)
def test_reshape_and_cache_int8(
    tokens, heads_dim, block_size, dtype, index_dtype, pad, transposed, magnitude
):
    # Bit for bit the reference: the int8 rows and their scales.
    hkv, d = heads_dim
    num_blocks = -(-tokens // block_size) + 2
    shape = (hkv, tokens, d) if transposed else (tokens, hkv, d)
    key, value = (torch.randn(shape) * magnitude for _ in range(2))
    key, value = key.to(dtype), value.to(dtype)
    if transposed:  # [Hkv, T, D] storage seen as [T, Hkv, D]
        key, value = key.transpose(0, 1), value.transpose(0, 1)
    if tokens > 2:
        key[1, 0] = 0  # an all-zero row: scale 0, stored 0
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    if pad:
        slots[::3] = -1
    slots = slots.to(index_dtype)
    kc = torch.randint(-127, 128, (num_blocks, block_size, hkv, d), dtype=torch.int8)
    vc = torch.randint(-127, 128, (num_blocks, block_size, hkv, d), dtype=torch.int8)
    ks, vs = torch.rand(num_blocks, block_size, hkv), torch.rand(num_blocks, block_size, hkv)
    ref = [t.clone() for t in (kc, vc, ks, vs)]
    torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots, key_scale=ks, value_scale=vs)
    reference.reshape_and_cache(key, value, *ref[:2], slots, key_scale=ref[2], value_scale=ref[3])
    for got, want in zip((kc, vc, ks, vs), ref, strict=True):
        assert torch.equal(got, want)


@requires_kernel("paged_attention")
@given(
    lens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 32, 100, 300, 700]), min_size=1, max_size=5),
    heads=st.sampled_from(HEADS),
    d=st.sampled_from([32, 64, 80, 128, 20]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 10, 200]),
    softcap=st.sampled_from([0.0, 0.0, 10.0]),
    scale=st.sampled_from([None, 0.2]),
)
@example([1, 16, 2048], (9, 3), 64, 16, torch.bfloat16, -1, 0.0, None)  # SmolLM2's heads
@example([33, 0, 64], (6, 1), 80, 32, torch.float16, 10, 10.0, 0.2)
@example([5, 1], (4, 2), 20, 1, torch.float32, 200, 0.0, None)
def test_paged_attention_int8(lens, heads, d, block_size, dtype, window, softcap, scale):
    hq, hkv = heads
    q, _, (kq, vq, ks, vs), bt, sl = _int8_paged(lens, hq, hkv, d, block_size, dtype)
    kw = dict(scale=scale, window_left=window, softcap=softcap, key_scale=ks, value_scale=vs)
    out = torch_topg.ops.paged_attention(q, kq, vq, bt, sl, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_attention(q, kq, vq, bt, sl, **kw))


@requires_kernel("paged_attention")
@given(
    seqs=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 15, 16, 17, 100, 300, 700]),
            st.sampled_from([0, 1, 5, 10**6]),  # new tokens (capped at the length)
        ),
        min_size=1,
        max_size=4,
    ),
    heads=st.sampled_from(HEADS),
    d=st.sampled_from([32, 64, 20]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, 0, 10, 200]),
    softcap=st.sampled_from([0.0, 10.0]),
)
@example([(700, 10**6), (17, 5), (0, 0)], (9, 3), 64, 16, torch.bfloat16, -1, 0.0)
def test_paged_attention_int8_ragged(seqs, heads, d, block_size, dtype, window, softcap):
    # Several new tokens per sequence (cu_seqlens_q): a prefill chunk over an int8 cache.
    hq, hkv = heads
    lens = [n for n, _ in seqs]
    q_lens = [min(n, k) for n, k in seqs]
    q, _, (kq, vq, ks, vs), bt, sl = _int8_paged(
        lens, hq, hkv, d, block_size, dtype, q_rows=sum(q_lens)
    )
    kw = dict(cu_seqlens_q=_cu(q_lens), window_left=window, softcap=softcap)
    kw.update(key_scale=ks, value_scale=vs)
    out = torch_topg.ops.paged_attention(q, kq, vq, bt, sl, **kw)
    assert_close(out, reference.paged_attention(q, kq, vq, bt, sl, **kw))


@requires_kernel("paged_attention")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_error_against_float_cache(dtype):
    # The int8 cache's attention against the float cache it quantises: small, and far
    # below the spread of the outputs (garbage would be of the order of 1).
    q, (kf, vf), (kq, vq, ks, vs), bt, sl = _int8_paged([2048, 700, 33], 9, 3, 64, 16, dtype)
    full = torch_topg.ops.paged_attention(q, kf, vf, bt, sl).float()
    quant = torch_topg.ops.paged_attention(q, kq, vq, bt, sl, key_scale=ks, value_scale=vs)
    err = (quant.float() - full).abs()
    assert float(err.max()) < 0.05 and float(err.mean()) < 0.01 * float(full.abs().mean()) + 2e-3


@requires_kernel("paged_attention")
def test_paged_attention_int8_batch_invariant():
    # A row's result is bitwise the same alone and among batch-mates, at any thread count.
    q, _, (kq, vq, ks, vs), bt, sl = _int8_paged(
        [1500, 5, 3000, 129, 1], 8, 2, 64, 16, torch.float32
    )
    kw = dict(key_scale=ks, value_scale=vs)
    batch = torch_topg.ops.paged_attention(q, kq, vq, bt, sl, **kw)
    assert torch.equal(
        batch[:1], torch_topg.ops.paged_attention(q[:1], kq, vq, bt[:1], sl[:1], **kw)
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(torch_topg.ops.paged_attention(q, kq, vq, bt, sl, **kw), batch)
    finally:
        torch.set_num_threads(threads)


def test_int8_opcheck():
    q, _, (kq, vq, ks, vs), bt, sl = _int8_paged([5, 20], 4, 2, 32, 16, torch.float32)
    kw = {"key_scale": ks, "value_scale": vs}
    torch.library.opcheck(torch.ops.topg.paged_attention.default, (q, kq, vq, bt, sl), kw)
    torch.library.opcheck(
        torch.ops.topg.paged_attention.default,
        (torch.randn(7, 4, 32), kq, vq, bt, sl),
        {"cu_seqlens_q": _cu([2, 5]), "window_left": 3, **kw},
    )
    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    torch.library.opcheck(
        torch.ops.topg.reshape_and_cache.default,
        (key, value, kq, vq, torch.tensor([0, -1, 40])),
        {"key_scale": ks, "value_scale": vs},
    )


def test_int8_decode_step_compile_fullgraph():
    # The engine's step: write the new tokens' K/V (quantised), then attend, compiled.
    def step(key, value, kc, vc, ks, vs, slots, q, bt, sl):
        torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots, key_scale=ks, value_scale=vs)
        return torch_topg.ops.paged_attention(q, kc, vc, bt, sl, key_scale=ks, value_scale=vs)

    q, _, caches, bt, sl = _int8_paged([5, 20], 4, 2, 32, 16, torch.float32)
    key, value = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    slots = torch.stack([bt[0, 0] * 16 + 4, bt[1, 1] * 16 + 3]).long()
    eager = [t.clone() for t in caches]
    expected = step(key, value, *eager, slots, q, bt, sl)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got_caches = [t.clone() for t in caches]
    got = compiled(key, value, *got_caches, slots, q, bt, sl)
    assert_close(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, eager, strict=True))


_q, _, (_kq, _vq, _ks, _vs), _bt, _sl = _int8_paged([5, 20], 4, 2, 32, 16, torch.float32)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({}, "argument 'key_scale' expected a float32 tensor .* with int8 caches, got None"),
        ({"key_scale": _ks}, "argument 'value_scale' expected a float32 tensor"),
        ({"key_scale": _ks, "value_scale": _vs.double()}, "argument 'value_scale'.*dtype float32"),
        (
            {"key_scale": _ks[:, :8].contiguous(), "value_scale": _vs},
            "argument 'key_scale'.*size 16 at dim 1",
        ),
        ({"key_scale": _ks, "value_scale": _vs[..., None]}, "argument 'value_scale'.*3 dim"),
    ],
)
def test_int8_bad_scales(kw, match):
    for fn in (torch_topg.ops.paged_attention, reference.paged_attention):
        if fn is reference.paged_attention:
            fn = torch_topg.ops.OPS["paged_attention"].check
        with pytest.raises(RuntimeError, match=match):
            fn(_q, _kq, _vq, _bt, _sl, **kw)
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.reshape_and_cache(
            torch.randn(2, 2, 32), torch.randn(2, 2, 32), _kq, _vq, torch.tensor([0, 1]), **kw
        )


def test_float_cache_refuses_scales():
    kf, vf = torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    match = "argument 'key_scale'.*expected None with float32 caches"
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.paged_attention(_q, kf, vf, _bt, _sl, key_scale=_ks, value_scale=_vs)
    with pytest.raises(RuntimeError, match="argument 'value_cache'.*dtype int8"):
        torch_topg.ops.paged_attention(_q, _kq, vf, _bt, _sl, key_scale=_ks, value_scale=_vs)
