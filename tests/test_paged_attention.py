"""paged_attention (decode, and several new tokens per sequence with cu_seqlens_q) and
reshape_and_cache against their references."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference

#: attention sinks: none, around the scores, or large enough to take most of the mass
SINKS = st.sampled_from(["none", "none", "randn", "large"])


def _sinks(kind: str, hq: int) -> torch.Tensor | None:
    """float32 [hq] sinks of a kind (see SINKS); one head's is -inf (no effect)."""
    if kind == "none":
        return None
    s = torch.randn(hq) * 2 if kind == "randn" else torch.full((hq,), 6.0)
    s[0] = float("-inf")
    return s


def _paged(lens, hq, hkv, d, block_size, dtype, spare_blocks=3):
    """Random caches with shuffled (non-contiguous) block tables for sequences `lens`."""
    max_blocks = max(1, max(-(-n // block_size) for n in lens)) + 1
    num_blocks = len(lens) * max_blocks + spare_blocks
    kc = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    vc = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    perm = torch.randperm(num_blocks)[: len(lens) * max_blocks]
    block_tables = perm.view(len(lens), max_blocks).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, dtype=dtype)
    return q, kc, vc, block_tables, seq_lens


@requires_kernel("paged_attention")
@given(
    lens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 32, 100, 300, 700]), min_size=1, max_size=5),
    heads=st.sampled_from([(1, 1), (4, 4), (4, 2), (8, 2), (32, 8), (6, 1), (3, 1)]),
    d=st.sampled_from([32, 64, 80, 128, 20]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 10, 200]),
    softcap=st.sampled_from([0.0, 0.0, 10.0]),
    scale=st.sampled_from([None, 0.2]),
    sinks=SINKS,
)
@example([1, 16, 700], (32, 8), 128, 16, torch.bfloat16, -1, 0.0, None, "none")
@example([2048], (8, 2), 64, 16, torch.float32, -1, 0.0, None, "none")  # split into partitions
@example([2048, 3], (8, 2), 64, 16, torch.float32, -1, 0.0, None, "randn")  # sinks, partitions
@example([33, 0, 64], (6, 1), 80, 32, torch.float16, 10, 10.0, 0.2, "large")
@example([5, 1], (4, 2), 20, 1, torch.float32, 200, 0.0, None, "none")
def test_paged_attention(lens, heads, d, block_size, dtype, window, softcap, scale, sinks):
    hq, hkv = heads
    q, kc, vc, bt, sl = _paged(lens, hq, hkv, d, block_size, dtype)
    kw = dict(scale=scale, window_left=window, softcap=softcap, sinks=_sinks(sinks, hq))
    out = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_attention(q, kc, vc, bt, sl, **kw))
    for s, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))


@requires_kernel("paged_attention")
def test_paged_attention_matches_prefill_last_row():
    # Decode of the last token == the last row of causal prefill over the same K/V.
    n, hq, hkv, d = 77, 8, 2, 64
    q, kc, vc, bt, sl = _paged([n], hq, hkv, d, 16, torch.float32)
    k = kc[bt[0].long()].flatten(0, 1)[:n]
    v = vc[bt[0].long()].flatten(0, 1)[:n]
    full_q = torch.randn(1, n, hq, d)
    full_q[0, -1] = q[0]
    prefill = torch_topg.ops.attention(full_q, k[None], v[None], causal=True)
    assert_close(torch_topg.ops.paged_attention(q, kc, vc, bt, sl)[0], prefill[0, -1])


def _cu(q_lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)


def _q_len(n: int, kind: str) -> int:
    """A query length for a sequence of n cached tokens: none, one, a few, or all."""
    return {"zero": 0, "one": min(n, 1), "few": min(n, 5), "all": n}[kind]


@requires_kernel("paged_attention")
@given(
    seqs=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 15, 16, 17, 100, 300, 700]),
            st.sampled_from(["zero", "one", "few", "all"]),
        ),
        min_size=1,
        max_size=4,
    ),
    heads=st.sampled_from([(1, 1), (4, 4), (4, 2), (8, 2), (32, 8), (6, 1), (3, 1)]),
    d=st.sampled_from([32, 64, 80, 128, 20]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 10, 200]),
    softcap=st.sampled_from([0.0, 0.0, 10.0]),
    scale=st.sampled_from([None, 0.2]),
    sinks=SINKS,
)
@example([(700, "all"), (17, "few"), (0, "zero")], (32, 8), 128, 16, torch.bfloat16, -1, 0.0, None, "none")  # fmt: skip
@example([(700, "all"), (17, "few"), (0, "zero")], (32, 8), 128, 16, torch.float32, -1, 0.0, None, "randn")  # fmt: skip
@example([(300, "few"), (16, "all"), (1, "one")], (6, 1), 80, 32, torch.float16, 10, 10.0, 0.2, "large")  # fmt: skip
@example([(100, "zero"), (15, "all")], (4, 2), 20, 1, torch.float32, 200, 0.0, None, "none")
def test_paged_attention_ragged(seqs, heads, d, block_size, dtype, window, softcap, scale, sinks):
    hq, hkv = heads
    lens = [n for n, _ in seqs]
    q_lens = [_q_len(n, kind) for n, kind in seqs]
    _, kc, vc, bt, sl = _paged(lens, hq, hkv, d, block_size, dtype)
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    kw = dict(cu_seqlens_q=_cu(q_lens), scale=scale, window_left=window, softcap=softcap,
              sinks=_sinks(sinks, hq))  # fmt: skip
    out = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, **kw)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_attention(q, kc, vc, bt, sl, **kw))


@requires_kernel("paged_attention")
def test_paged_attention_ragged_one_token_each_is_decode():
    # All q_len == 1: the ragged form is the plain form, bitwise. (A plain query of a
    # sequence with seq_len 0 gives zeros; in the ragged form q_len 1 > 0 is an error.)
    q, kc, vc, bt, sl = _paged([1, 700, 33, 2, 2100], 8, 2, 64, 16, torch.bfloat16)
    for kw in ({}, {"window_left": 50, "softcap": 5.0}, {"sinks": _sinks("randn", 8)}):
        plain = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, **kw)
        ragged = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=_cu([1] * 5), **kw)
        assert torch.equal(plain, ragged)


@requires_kernel("paged_attention")
@pytest.mark.parametrize(("window", "sinks"), [(-1, "none"), (40, "none"), (40, "randn")])
def test_paged_attention_prefill_chunk_matches_causal_attention(window, sinks):
    # A chunk of the last 50 tokens over 300 cached ones == the last 50 rows of causal
    # prefill attention over the gathered K/V; the whole prompt (q_len == seq_len) too.
    n, hq, hkv, d = 300, 8, 2, 64
    _, kc, vc, bt, sl = _paged([n], hq, hkv, d, 16, torch.float32)
    k = kc[bt[0].long()].flatten(0, 1)[:n]
    v = vc[bt[0].long()].flatten(0, 1)[:n]
    full_q = torch.randn(1, n, hq, d)
    kw = dict(window_left=window, sinks=_sinks(sinks, hq))
    prefill = torch_topg.ops.attention(full_q, k[None], v[None], causal=True, **kw)
    for chunk in (50, n):  # 50: the dense kernel's rows (paged_kernels.h kDenseRows)
        out = torch_topg.ops.paged_attention(
            full_q[0, n - chunk :], kc, vc, bt, sl, cu_seqlens_q=_cu([chunk]), **kw
        )
        assert_close(out, prefill[0, n - chunk :])


@requires_kernel("paged_attention")
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_attention_batch_invariant(dtype):
    # A sequence's output is bitwise the same alone and among batch-mates of other
    # lengths, whatever the thread count, in the plain and the ragged form; a ragged row
    # equals the decode of that token (speculative verification == one step at a time).
    hq, hkv, d, bs = 8, 2, 64, 16
    mates = [5, 3000, 129, 700, 1, 2048]
    q, kc, vc, bt, sl = _paged([1500, *mates], hq, hkv, d, bs, dtype)
    for kw in ({}, {"window_left": 600}, {"softcap": 20.0}, {"sinks": _sinks("randn", hq)}):
        batch = torch_topg.ops.paged_attention(q, kc, vc, bt, sl, **kw)
        alone = torch_topg.ops.paged_attention(q[:1], kc, vc, bt[:1], sl[:1], **kw)
        assert torch.equal(batch[:1], alone)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(torch_topg.ops.paged_attention(q, kc, vc, bt, sl, **kw), batch)
        finally:
            torch.set_num_threads(threads)

        # Ragged: 4 new tokens of sequence 0 (positions 1496..1499), with mates.
        q_lens = [4, 2, 300, 0, 7, 1, 1000]
        rq = torch.randn(sum(q_lens), hq, d, dtype=dtype)
        ragged = torch_topg.ops.paged_attention(rq, kc, vc, bt, sl, cu_seqlens_q=_cu(q_lens), **kw)
        ragged_alone = torch_topg.ops.paged_attention(
            rq[:4], kc, vc, bt[:1], sl[:1], cu_seqlens_q=_cu([4]), **kw
        )
        assert torch.equal(ragged[:4], ragged_alone)
        for i in range(4):  # row i is the decode of the token at position 1496 + i
            step = torch_topg.ops.paged_attention(
                rq[i : i + 1], kc, vc, bt[:1], torch.tensor([1497 + i], dtype=torch.int32), **kw
            )
            assert torch.equal(ragged[i : i + 1], step)
        # The 1000 new tokens of the last sequence (positions 1048..2047, rows processed
        # in groups that share K/V reads): some rows against their own decode step.
        # Runs of 16+ rows take the dense prefill kernel (other rounding: close, not
        # equal), except in batch-invariant mode, where they stay paged (bitwise).
        r0 = sum(q_lens[:-1])
        prev = torch.ops.topg._set_batch_invariant.default(True)
        try:
            invariant = torch_topg.ops.paged_attention(
                rq, kc, vc, bt, sl, cu_seqlens_q=_cu(q_lens), **kw
            )
        finally:
            torch.ops.topg._set_batch_invariant.default(prev)
        for i in (0, 1, 15, 16, 17, 31, 500, 999):
            step = torch_topg.ops.paged_attention(
                rq[r0 + i : r0 + i + 1], kc, vc, bt[-1:], torch.tensor([1049 + i]).int(), **kw
            )
            assert torch.equal(invariant[r0 + i : r0 + i + 1], step)
            assert_close(ragged[r0 + i : r0 + i + 1], step)


@requires_kernel("reshape_and_cache")
@given(
    tokens=st.integers(1, 40),
    heads_dim=st.sampled_from([(1, 32), (2, 64), (8, 128), (3, 20)]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from([torch.int64, torch.int32]),
    pad=st.booleans(),
    transposed=st.booleans(),
)
@example(17, (8, 128), 16, torch.bfloat16, torch.int64, True, True)
def test_reshape_and_cache(tokens, heads_dim, block_size, dtype, index_dtype, pad, transposed):
    hkv, d = heads_dim
    num_blocks = -(-tokens // block_size) + 2
    if transposed:  # [Hkv, T, D] storage seen as [T, Hkv, D]
        key = torch.randn(hkv, tokens, d, dtype=dtype).transpose(0, 1)
        value = torch.randn(hkv, tokens, d, dtype=dtype).transpose(0, 1)
    else:
        key = torch.randn(tokens, hkv, d, dtype=dtype)
        value = torch.randn(tokens, hkv, d, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size)[:tokens]
    if pad:
        slots[::3] = -1  # padding tokens are skipped
    slots = slots.to(index_dtype)
    kc = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    vc = torch.randn(num_blocks, block_size, hkv, d, dtype=dtype)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots)
    reference.reshape_and_cache(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)  # exact copies


def test_paged_opcheck():
    q, kc, vc, bt, sl = _paged([5, 20], 4, 2, 32, 16, torch.float32)
    torch.library.opcheck(torch.ops.topg.paged_attention.default, (q, kc, vc, bt, sl))
    torch.library.opcheck(
        torch.ops.topg.paged_attention.default,
        (q, kc, vc, bt, sl),
        {"window_left": 4, "softcap": 5.0, "scale": 0.1},
    )
    torch.library.opcheck(
        torch.ops.topg.paged_attention.default,
        (torch.randn(7, 4, 32), kc, vc, bt, sl),
        {"cu_seqlens_q": _cu([2, 5]), "window_left": 3},
    )
    key, value = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    torch.library.opcheck(
        torch.ops.topg.reshape_and_cache.default, (key, value, kc, vc, torch.tensor([0, -1, 40]))
    )


def test_attention_family_compile_fullgraph():
    def decode_step(key, value, kc, vc, slots, q, bt, sl):
        torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots)
        return torch_topg.ops.paged_attention(q, kc, vc, bt, sl)

    q, kc, vc, bt, sl = _paged([5, 20], 4, 2, 32, 16, torch.float32)
    key, value = torch.randn(2, 2, 32), torch.randn(2, 2, 32)
    # The current tokens (positions 4 and 19) go to their slots, then attend.
    slots = torch.stack([bt[0, 0] * 16 + 4, bt[1, 1] * 16 + 3]).long()
    args = (key, value, kc.clone(), vc.clone(), slots, q, bt, sl)
    expected = decode_step(*args)
    compiled = torch.compile(decode_step, fullgraph=True, backend="aot_eager")
    kc2, vc2 = kc.clone(), vc.clone()
    got = compiled(key, value, kc2, vc2, slots, q, bt, sl)
    assert_close(got, expected)
    assert torch.equal(kc2, args[2]) and torch.equal(vc2, args[3])


def test_paged_attention_ragged_compile_fullgraph():
    # A prefill chunk step: write the chunk's K/V into the cache, then attend in place.
    def chunk_step(key, value, kc, vc, slots, q, bt, sl, cu):
        torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots)
        return torch_topg.ops.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=cu, softcap=5.0)

    _, kc, vc, bt, sl = _paged([5, 20], 4, 2, 32, 16, torch.float32)
    cu = _cu([2, 3])  # the last 2 tokens of sequence 0, the last 3 of sequence 1
    key, value, q = torch.randn(5, 2, 32), torch.randn(5, 2, 32), torch.randn(5, 4, 32)
    pos = [(0, 3), (0, 4), (1, 17), (1, 18), (1, 19)]
    slots = torch.stack([bt[s, p // 16] * 16 + p % 16 for s, p in pos]).long()
    expected = chunk_step(key, value, kc.clone(), vc.clone(), slots, q, bt, sl, cu)
    compiled = torch.compile(chunk_step, fullgraph=True, backend="aot_eager")
    got = compiled(key, value, kc.clone(), vc.clone(), slots, q, bt, sl, cu)
    assert_close(got, expected)


_q, _kc, _vc, _bt, _sl = _paged([5, 20], 4, 2, 32, 16, torch.float32)
_rq = torch.randn(7, 4, 32)  # ragged: 2 new tokens of sequence 0, 5 of sequence 1
_ok_cu = _cu([2, 5])


@pytest.mark.parametrize(
    "args, match",
    [
        ((_q.half(), _kc, _vc, _bt, _sl), "argument 'key_cache'.*expected dtype float16"),
        ((_q[:, :3], _kc, _vc, _bt, _sl), "multiple of key/value"),
        ((_q[0], _kc, _vc, _bt, _sl), "argument 'query'.*expected 3 dimensions"),
        ((_q, _kc[..., :16], _vc[..., :16], _bt, _sl), "argument 'key_cache'.*head_dim"),
        ((_q, _kc, _vc[:, :8], _bt, _sl), "argument 'value_cache'"),
        ((_q, _kc, _vc, _bt.long(), _sl), "argument 'block_tables'.*int32"),
        ((_q, _kc, _vc, _bt, _sl[:1]), "argument 'seq_lens'"),
        ((_q, _kc, _vc, _bt[0], _sl), "argument 'block_tables'.*2 dimensions"),
        ((_rq, _kc, _vc, _bt, _sl, _ok_cu.long()), "argument 'cu_seqlens_q'.*int32"),
        ((_rq, _kc, _vc, _bt, _sl, _ok_cu.float()), "argument 'cu_seqlens_q'.*int32"),
        ((_rq, _kc, _vc, _bt, _sl, _ok_cu[:2]), "argument 'cu_seqlens_q'.*size 3.*num_seqs"),
        ((_rq, _kc, _vc, _bt, _sl, _ok_cu[None]), "argument 'cu_seqlens_q'.*1 dimensions"),
        ((_rq, _kc, _vc, _bt[:1], _sl, _ok_cu), "argument 'block_tables'.*num_seqs"),
    ],
)
def test_paged_attention_bad_input(args, match):
    *args, cu = args if len(args) == 6 else (*args, None)
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.paged_attention(*args, cu_seqlens_q=cu)
    with pytest.raises(RuntimeError, match=match):  # the fake kernel checks the same
        with torch._subclasses.FakeTensorMode() as mode:
            fake_cu = None if cu is None else mode.from_tensor(cu)
            torch_topg.ops.paged_attention(
                *(mode.from_tensor(a) for a in args), cu_seqlens_q=fake_cu
            )


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_paged_attention_bad_indices(impl):
    fn = torch_topg.ops.paged_attention if impl == "native" else reference.paged_attention
    bt = _bt.clone()
    bt[1, 1] = _kc.shape[0]  # used by sequence 1 (20 tokens = 2 blocks)
    with pytest.raises(RuntimeError, match="argument 'block_tables'.*block ids"):
        fn(_q, _kc, _vc, bt, _sl)
    bt = _bt.clone()
    bt[1, 1] = -1
    with pytest.raises(RuntimeError, match="argument 'block_tables'.*block ids"):
        fn(_q, _kc, _vc, bt, _sl)
    bt = _bt.clone()
    bt[0, 1] = 10**6  # not used by sequence 0 (5 tokens = 1 block): fine
    fn(_q, _kc, _vc, bt, _sl)
    too_long = torch.tensor([5, _bt.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="argument 'seq_lens'"):
        fn(_q, _kc, _vc, _bt, too_long)


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize(
    "q_lens, lens, match",
    [
        ([6, 1], [5, 20], "at most seq_lens\\[0\\] = 5 query tokens for sequence 0.*got 6"),
        ([0, 21], [5, 20], "at most seq_lens\\[1\\] = 20 query tokens"),
        ([1, 1], [0, 20], "at most seq_lens\\[0\\] = 0 query tokens"),
    ],
)
def test_paged_attention_ragged_longer_than_sequence(impl, q_lens, lens, match):
    fn = torch_topg.ops.paged_attention if impl == "native" else reference.paged_attention
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(sum(q_lens), 4, 32)
    with pytest.raises(RuntimeError, match="argument 'cu_seqlens_q'.*" + match):
        fn(q, _kc, _vc, _bt, sl, cu_seqlens_q=_cu(q_lens))


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize(
    "offsets",
    [[0, 5, 2], [0, 8, 7], [1, 3, 7], [0, 2, 6], [0, 2, 8], [0, -1, 7], [-3, 2, 7]],
)
def test_paged_attention_bad_offsets(impl, offsets):
    # Decreasing, not starting at 0, not ending at Tq (7): a clear error, never a crash.
    fn = torch_topg.ops.paged_attention if impl == "native" else reference.paged_attention
    cu = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="argument 'cu_seqlens_q'.*non-decreasing offsets"):
        fn(_rq, _kc, _vc, _bt, _sl, cu_seqlens_q=cu)
    fn(_rq, _kc, _vc, _bt, _sl, cu_seqlens_q=_ok_cu)  # the good offsets run


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_paged_attention_ragged_bad_indices(impl):
    # The block-table and length checks hold in the ragged form too.
    fn = torch_topg.ops.paged_attention if impl == "native" else reference.paged_attention
    bt = _bt.clone()
    bt[1, 1] = -1
    with pytest.raises(RuntimeError, match="argument 'block_tables'.*block ids"):
        fn(_rq, _kc, _vc, bt, _sl, cu_seqlens_q=_ok_cu)
    too_long = torch.tensor([5, _bt.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="argument 'seq_lens'"):
        fn(_rq, _kc, _vc, _bt, too_long, cu_seqlens_q=_ok_cu)
    empty = fn(torch.randn(0, 4, 32), _kc, _vc, _bt, _sl, cu_seqlens_q=_cu([0, 0]))
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("impl", ["native", "reference"])
def test_reshape_and_cache_bad_slot(impl):
    fn = torch_topg.ops.reshape_and_cache if impl == "native" else reference.reshape_and_cache
    kc, vc = _kc.clone(), _vc.clone()
    key = torch.randn(2, 2, 32)
    with pytest.raises(RuntimeError, match="argument 'slot_mapping'"):
        fn(key, key, kc, vc, torch.tensor([0, kc.shape[0] * 16]))
    assert torch.equal(kc, _kc)  # nothing written


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.randn(2, 2, 32).half(),) * 2 + (_kc, _vc), "argument 'key_cache'.*dtype"),
        ((torch.randn(2, 3, 32),) * 2 + (_kc, _vc), "argument 'key_cache'.*kv heads"),
        ((torch.randn(2, 2, 16),) * 2 + (_kc, _vc), "argument 'key_cache'.*head_dim"),
        ((torch.randn(2, 32),) * 2 + (_kc, _vc), "argument 'key'.*3 dimensions"),
        ((torch.randn(2, 2, 32),) * 2 + (_kc, _vc[:3]), "argument 'value_cache'"),
    ],
)
def test_reshape_and_cache_bad_input(args, match):
    slots = torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.reshape_and_cache(*args, slots)
    with pytest.raises(RuntimeError, match=match):
        with torch._subclasses.FakeTensorMode() as mode:
            torch_topg.ops.reshape_and_cache(*(mode.from_tensor(a) for a in (*args, slots)))


def test_reshape_and_cache_bad_slot_mapping():
    key = torch.randn(2, 2, 32)
    for slots in (torch.tensor([0.0, 1.0]), torch.tensor([[0, 1]]), torch.tensor([0, 1, 2])):
        with pytest.raises(RuntimeError, match="argument 'slot_mapping'"):
            torch_topg.ops.reshape_and_cache(key, key, _kc.clone(), _vc.clone(), slots)


_AVX2_PAGED = """
import sys, torch, torch_topg
cases = torch.load(sys.argv[1])
torch.save([torch_topg.ops.paged_attention(*a, cu_seqlens_q=cu, sinks=s) for a, cu, s in cases],
           sys.argv[2])
"""


@requires_kernel("paged_attention")
def test_bf16_dot_path_and_avx2_path_match_the_reference(tmp_path):
    """bf16 caches with a head dim that is a multiple of 32 take the AVX-512 BF16 path
    (paged_bf16dp.h) on CPUs that have it, the AVX2 path elsewhere. The AVX2 path runs in a
    subprocess with TOPG_DISABLE_AVX512=1; both are compared with the reference (decode and
    ragged rows, odd key counts, every head-group width, with and without sinks), and with
    each other."""
    import os
    import subprocess
    import sys

    torch.manual_seed(3)
    cases, refs = [], []
    for lens, (hq, hkv), d in [
        ([1, 17, 300, 33], (9, 3), 64),
        ([700, 5], (8, 2), 128),
        ([129, 16], (4, 4), 32),
        ([45], (4, 2), 256),
        ([3, 64], (6, 1), 96),
    ]:
        q, kc, vc, bt, sl = _paged(lens, hq, hkv, d, 16, torch.bfloat16)
        q_lens = [min(n, 4) for n in lens]
        qr = torch.randn(sum(q_lens), hq, d, dtype=torch.bfloat16)
        for sinks in (None, _sinks("randn", hq)):
            cases.append(((q, kc, vc, bt, sl), None, sinks))
            cases.append(((qr, kc, vc, bt, sl), _cu(q_lens), sinks))
    for (q, kc, vc, bt, sl), cu, sinks in cases:
        refs.append(reference.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=cu, sinks=sinks))
    inp, out, script = tmp_path / "in.pt", tmp_path / "out.pt", tmp_path / "avx2.py"
    torch.save(cases, inp)
    script.write_text(_AVX2_PAGED)
    env = {**os.environ, "TOPG_DISABLE_AVX512": "1"}
    subprocess.run([sys.executable, str(script), str(inp), str(out)], env=env, check=True,
                   cwd=tmp_path, timeout=300)  # fmt: skip
    avx2 = torch.load(out, weights_only=False)
    for (args, cu, sinks), ref, theirs in zip(cases, refs, avx2, strict=True):
        ours = torch_topg.ops.paged_attention(*args, cu_seqlens_q=cu, sinks=sinks)
        assert_close(ours, ref)
        assert_close(theirs, ref)
        assert_close(ours, theirs)
