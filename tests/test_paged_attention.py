"""paged_attention (decode) and reshape_and_cache against their references."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference


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
)
@example([1, 16, 700], (32, 8), 128, 16, torch.bfloat16, -1, 0.0, None)
@example([2048], (8, 2), 64, 16, torch.float32, -1, 0.0, None)  # split into partitions
@example([33, 0, 64], (6, 1), 80, 32, torch.float16, 10, 10.0, 0.2)
@example([5, 1], (4, 2), 20, 1, torch.float32, 200, 0.0, None)
def test_paged_attention(lens, heads, d, block_size, dtype, window, softcap, scale):
    hq, hkv = heads
    q, kc, vc, bt, sl = _paged(lens, hq, hkv, d, block_size, dtype)
    kw = dict(scale=scale, window_left=window, softcap=softcap)
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


_q, _kc, _vc, _bt, _sl = _paged([5, 20], 4, 2, 32, 16, torch.float32)


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
    ],
)
def test_paged_attention_bad_input(args, match):
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.paged_attention(*args)
    with pytest.raises(RuntimeError, match=match):  # the fake kernel checks the same
        with torch._subclasses.FakeTensorMode() as mode:
            torch_topg.ops.paged_attention(*(mode.from_tensor(a) for a in args))


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
