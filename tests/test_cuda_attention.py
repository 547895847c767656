"""CUDA attention kernels (prefill ``attention``, decode ``paged_attention``) against their
references on the same GPU; skips without a CUDA device or without the CUDA kernels.

The samples, opcheck, bad inputs and NaN / inf / empty cases shared with the CPU run
from tests/op_samples.py in tests/test_ops_common.py. Awkward on purpose here: head_dim 20 / 80 (scalar K loads, padded lanes), 256 (the wide
variant), contexts that are not multiples of the block size or of the 256-key split
partitions, query groups larger than the 8 rows of one block, empty sequences.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DTYPES, NEEDS_CUDA, assert_close, requires_cuda_kernel
from hypothesis import example, given
from hypothesis import strategies as st
from op_samples import Gen, paged

import torch_topg
from torch_topg import reference

pytestmark = NEEDS_CUDA
DEV = "cuda"


def _paged(lens, hq, hkv, d, block_size, dtype):
    """Caches with shuffled block tables for sequences of lengths `lens` (op_samples)."""
    return paged(Gen(DEV), lens, hq, hkv, d, block_size, dtype)


@requires_cuda_kernel("paged_attention")
@given(
    lens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 255, 257, 700, 2049]), min_size=1, max_size=5),
    heads=st.sampled_from([(1, 1), (4, 4), (8, 2), (32, 8), (6, 1), (12, 1), (20, 2)]),
    d=st.sampled_from([20, 64, 80, 128, 256]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 10, 300]),
    softcap=st.sampled_from([0.0, 0.0, 10.0]),
    scale=st.sampled_from([None, 0.2]),
)
@example([1, 16, 700], (32, 8), 128, 16, torch.bfloat16, -1, 0.0, None)
@example([4097], (8, 1), 128, 16, torch.float16, -1, 0.0, None)  # many partitions
@example([2049, 0, 3], (12, 1), 80, 32, torch.float32, 300, 10.0, 0.2)  # 2 group chunks
@example([5, 1], (4, 2), 20, 1, torch.float32, -1, 0.0, None)
def test_cuda_paged_attention(lens, heads, d, block_size, dtype, window, softcap, scale):
    hq, hkv = heads
    q, kc, vc, bt, sl = _paged(lens, hq, hkv, d, block_size, dtype)
    kw = dict(scale=scale, window_left=window, softcap=softcap)
    out = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_attention(q, kc, vc, bt, sl, **kw))
    for s, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))


@requires_cuda_kernel("paged_attention")
def test_cuda_paged_attention_bad_indices():
    q, kc, vc, bt, sl = _paged([5, 20], 4, 2, 32, 16, torch.float32)
    bad = bt.clone()
    bad[1, 1] = kc.shape[0]  # used by sequence 1 (20 tokens = 2 blocks)
    with pytest.raises(RuntimeError, match="argument 'block_tables'.*block ids"):
        torch_topg.ops.paged_attention(q, kc, vc, bad, sl)
    unused = bt.clone()
    unused[0, 1] = 10**6  # not used by sequence 0 (5 tokens): fine
    torch_topg.ops.paged_attention(q, kc, vc, unused, sl)
    too_long = torch.tensor([5, bt.shape[1] * 16 + 1], dtype=torch.int32, device=DEV)
    with pytest.raises(RuntimeError, match="argument 'seq_lens'"):
        torch_topg.ops.paged_attention(q, kc, vc, bt, too_long)


def _cu(q_lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEV)


@requires_cuda_kernel("paged_attention")
@given(
    seqs=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 17, 255, 257, 700, 2049]),
            st.sampled_from(["zero", "one", "few", "all"]),
        ),
        min_size=1,
        max_size=4,
    ),
    heads=st.sampled_from([(1, 1), (8, 2), (32, 8), (12, 1)]),
    d=st.sampled_from([20, 64, 128, 256]),
    block_size=st.sampled_from([1, 16]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 300]),
    softcap=st.sampled_from([0.0, 10.0]),
)
@example([(2049, "all"), (17, "few"), (0, "zero")], (32, 8), 128, 16, torch.bfloat16, -1, 0.0)
@example([(700, "few"), (257, "one")], (12, 1), 80, 16, torch.float32, 300, 10.0)
def test_cuda_paged_attention_ragged(seqs, heads, d, block_size, dtype, window, softcap):
    # Several new tokens per sequence (cu_seqlens_q), causal among them.
    hq, hkv = heads
    lens = [n for n, _ in seqs]
    q_lens = [{"zero": 0, "one": min(n, 1), "few": min(n, 5), "all": n}[k] for n, k in seqs]
    _, kc, vc, bt, sl = _paged(lens, hq, hkv, d, block_size, dtype)
    q = torch.randn(sum(q_lens), hq, d, device=DEV).to(dtype)
    kw = dict(cu_seqlens_q=_cu(q_lens), window_left=window, softcap=softcap)
    out = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_attention(q, kc, vc, bt, sl, **kw))


@requires_cuda_kernel("paged_attention")
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_paged_attention_batch_invariant(dtype):
    # Bitwise: a sequence alone == in a batch (other lengths, other table widths); a
    # ragged row == the decode of its token; ragged with q_len 1 == the plain form.
    q, kc, vc, bt, sl = _paged([1500, 5, 20000, 129, 700, 1, 2048], 8, 2, 128, 16, dtype)
    batch = torch_topg.ops.paged_attention(q, kc, vc, bt, sl)
    alone = torch_topg.ops.paged_attention(q[:1], kc, vc, bt[:1, :96], sl[:1])  # fewer slots
    assert torch.equal(batch[:1], alone)
    # 129 tokens alone in a 256-token table: one partition slot, the direct-write path.
    alone = torch_topg.ops.paged_attention(q[3:4], kc, vc, bt[3:4, :16], sl[3:4])
    assert torch.equal(batch[3:4], alone)
    q_lens = [4, 2, 300, 0, 7, 1, 1000]
    rq = torch.randn(sum(q_lens), 8, 128, device=DEV).to(dtype)
    ragged = torch_topg.ops.paged_attention(rq, kc, vc, bt, sl, cu_seqlens_q=_cu(q_lens))
    for i in range(4):
        step_len = torch.tensor([1497 + i], dtype=torch.int32, device=DEV)
        step = torch_topg.ops.paged_attention(rq[i : i + 1], kc, vc, bt[:1], step_len)
        assert torch.equal(ragged[i : i + 1], step)
    ones = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=_cu([1] * 7))
    assert torch.equal(ones, batch)


@requires_cuda_kernel("paged_attention")
def test_cuda_paged_attention_bad_offsets():
    _, kc, vc, bt, sl = _paged([5, 20], 4, 2, 32, 16, torch.float32)
    q = torch.randn(7, 4, 32, device=DEV)
    for offsets in ([0, 5, 2], [1, 3, 7], [0, 2, 8]):
        cu = torch.tensor(offsets, dtype=torch.int32, device=DEV)
        with pytest.raises(RuntimeError, match="argument 'cu_seqlens_q'.*non-decreasing"):
            torch_topg.ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=cu)
    with pytest.raises(RuntimeError, match="argument 'cu_seqlens_q'.*at most seq_lens"):
        torch_topg.ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=_cu([6, 1]))


def _qkv(b, sq, sk, hq, hkv, d, dtype, transposed=False):
    if transposed:  # [B, H, S, D] storage seen as [B, S, H, D]
        mk = lambda s, h: torch.randn(b, h, s, d, device=DEV).to(dtype).transpose(1, 2)  # noqa: E731
    else:
        mk = lambda s, h: torch.randn(b, s, h, d, device=DEV).to(dtype)  # noqa: E731
    return mk(sq, hq), mk(sk, hkv), mk(sk, hkv)


@requires_cuda_kernel("attention")
@given(
    b=st.integers(1, 2),
    sq=st.sampled_from([1, 2, 7, 8, 9, 63, 129]),
    extra_k=st.sampled_from([0, 0, 3, 40]),
    heads=st.sampled_from([(1, 1), (4, 2), (8, 2), (6, 1), (4, 4)]),
    d=st.sampled_from([20, 64, 80, 128, 256]),
    dtype=st.sampled_from(DTYPES),
    causal=st.booleans(),
    window=st.sampled_from([-1, -1, 0, 7, 50]),
    softcap=st.sampled_from([0.0, 0.0, 5.0]),
    transposed=st.booleans(),
)
@example(1, 129, 0, (8, 2), 128, torch.bfloat16, True, -1, 0.0, True)
@example(2, 9, 40, (4, 1), 80, torch.float16, True, 7, 5.0, False)
@example(1, 1, 0, (4, 4), 256, torch.float32, False, -1, 0.0, False)
def test_cuda_attention(b, sq, extra_k, heads, d, dtype, causal, window, softcap, transposed):
    hq, hkv = heads
    q, k, v = _qkv(b, sq, sq + extra_k, hq, hkv, d, dtype, transposed)
    kw = dict(causal=causal, window_left=window, softcap=softcap)
    out = torch_topg.ops.attention(q, k, v, **kw)
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.attention(q, k, v, **kw))


@requires_cuda_kernel("attention")
@pytest.mark.parametrize("kind", ["bool", "additive", "per_head"])
def test_cuda_attention_mask(kind):
    b, sq, sk, hq, hkv, d = 2, 33, 70, 4, 2, 64
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, torch.bfloat16)
    if kind == "bool":
        mask = torch.rand(b, 1, sq, sk, device=DEV) > 0.3
        mask[0, 0, 5] = False  # a fully masked row: zeros
    elif kind == "per_head":
        mask = torch.rand(hq, 1, sk, device=DEV) > 0.5
    else:
        mask = torch.randn(b, 1, 1, sk, device=DEV)
        mask[1, ..., :20] = float("-inf")
    out = torch_topg.ops.attention(q, k, v, causal=True, mask=mask)
    assert_close(out, reference.attention(q, k, v, causal=True, mask=mask))
    assert not out.isnan().any()


@requires_cuda_kernel("attention")
@given(
    lengths=st.lists(st.sampled_from([0, 1, 17, 63, 65, 129]), min_size=1, max_size=4),
    heads=st.sampled_from([(4, 2), (6, 1), (2, 2)]),
    dtype=st.sampled_from(DTYPES),
    causal=st.booleans(),
    separate_k=st.booleans(),
)
def test_cuda_attention_ragged(lengths, heads, dtype, causal, separate_k):
    hq, hkv = heads
    lk = [n + 5 for n in lengths] if separate_k else lengths
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, 64, device=DEV).to(dtype)
    k = torch.randn(int(cu_k[-1]), hkv, 64, device=DEV).to(dtype)
    v = torch.randn(int(cu_k[-1]), hkv, 64, device=DEV).to(dtype)
    kw = dict(
        cu_seqlens_q=cu_q.to(DEV), cu_seqlens_k=cu_k.to(DEV) if separate_k else None, causal=causal
    )
    assert_close(torch_topg.ops.attention(q, k, v, **kw), reference.attention(q, k, v, **kw))


@requires_cuda_kernel("paged_attention")
def test_cuda_decode_matches_prefill_last_row():
    n, hq, hkv, d = 777, 8, 2, 128
    q, kc, vc, bt, sl = _paged([n], hq, hkv, d, 16, torch.bfloat16)
    k = kc[bt[0].long()].flatten(0, 1)[:n]
    v = vc[bt[0].long()].flatten(0, 1)[:n]
    full_q = torch.randn(1, n, hq, d, device=DEV).to(torch.bfloat16)
    full_q[0, -1] = q[0]
    prefill = torch_topg.ops.attention(full_q, k[None], v[None], causal=True)
    assert_close(torch_topg.ops.paged_attention(q, kc, vc, bt, sl)[0], prefill[0, -1])


@requires_cuda_kernel("paged_attention")
def test_cuda_decode_step_compiles_and_captures():
    """torch.compile (fullgraph) of a decode step, and a CUDA graph capture of it: the
    host-side index checks must step aside during capture (no sync allowed there)."""

    def step(key, value, kc, vc, slots, q, bt, sl):
        torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots)
        return torch_topg.ops.paged_attention(q, kc, vc, bt, sl)

    q, kc, vc, bt, sl = _paged([5, 20], 4, 2, 64, 16, torch.bfloat16)
    key = torch.randn(2, 2, 64, device=DEV).to(torch.bfloat16)
    slots = torch.stack([bt[0, 0] * 16 + 4, bt[1, 1] * 16 + 3]).long()
    expected = step(key, key, kc.clone(), vc.clone(), slots, q, bt, sl)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert_close(compiled(key, key, kc.clone(), vc.clone(), slots, q, bt, sl), expected)
    kc2, vc2 = kc.clone(), vc.clone()
    step(key, key, kc2, vc2, slots, q, bt, sl)  # warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(key, key, kc2, vc2, slots, q, bt, sl)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, expected)


@requires_cuda_kernel("paged_attention")
@given(
    lens=st.lists(st.sampled_from([0, 1, 17, 257, 700, 2049]), min_size=1, max_size=4),
    heads=st.sampled_from([(1, 1), (9, 3), (8, 2), (12, 1)]),
    d=st.sampled_from([20, 64, 128, 256]),
    block_size=st.sampled_from([1, 16]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, 10]),
    ragged=st.booleans(),
)
@example([2049, 17, 0], (9, 3), 64, 16, torch.bfloat16, -1, False)  # SmolLM2's heads
def test_cuda_paged_attention_int8(lens, heads, d, block_size, dtype, window, ragged):
    # An int8 cache written by the CUDA reshape_and_cache (bit for bit the reference's),
    # read by the CUDA paged_attention (against the reference on the same int8 cache).
    hq, hkv = heads
    q, kf, vf, bt, sl = _paged(lens, hq, hkv, d, block_size, dtype)
    kq, vq = torch.zeros_like(kf, dtype=torch.int8), torch.zeros_like(vf, dtype=torch.int8)
    ks, vs = (torch.zeros(kf.shape[:3], device=DEV) for _ in range(2))
    slots = torch.arange(kf.shape[0] * block_size, device=DEV)
    torch_topg.ops.reshape_and_cache(
        kf.flatten(0, 1), vf.flatten(0, 1), kq, vq, slots, key_scale=ks, value_scale=vs
    )
    (rk, rks), (rv, rvs) = reference.quantize_kv(kf), reference.quantize_kv(vf)
    assert torch.equal(kq, rk) and torch.equal(vq, rv)
    assert torch.equal(ks, rks) and torch.equal(vs, rvs)
    kw = dict(window_left=window, key_scale=ks, value_scale=vs)
    if ragged:  # the last min(n, 3) tokens of each sequence
        q_lens = [min(n, 3) for n in lens]
        q = Gen(DEV, seed=3).randn(sum(q_lens), hq, d, dtype=dtype)
        kw["cu_seqlens_q"] = torch.tensor([0, *itertools.accumulate(q_lens)], device=DEV).int()
    out = torch_topg.ops.paged_attention(q, kq, vq, bt, sl, **kw)
    assert_close(out, reference.paged_attention(q, kq, vq, bt, sl, **kw))
