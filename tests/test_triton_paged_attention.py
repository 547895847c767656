"""The Triton paged_attention kernels (torch_topg.triton_kernels.paged_attention) against
torch_topg.reference.paged_attention, under Triton's interpreter on CPU tensors.

TRITON_INTERPRET=1 is set here, before triton is imported. The interpreter's fp32 and
fp16 ``tl.dot`` are exact, its bf16 ``tl.dot`` is wrong (bf16 is held as uint16), so the
cases run fp32 and fp16 and the bf16 ones skip saying so. With
``TOPG_TRITON_TEST_CUDA=1`` on a machine with a GPU the same tests run compiled on CUDA
tensors, bf16 included. The interpreter is slow: small shapes and few examples keep the
module near a minute on two cores.
"""

from __future__ import annotations

import importlib
import itertools
import os

import pytest
import torch

ON_GPU = os.environ.get("TOPG_TRITON_TEST_CUDA") == "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are defined (import)


from conftest import assert_close  # noqa: E402
from hypothesis import example, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from torch_topg import reference  # noqa: E402
from torch_topg.triton_kernels import paged_attention as tpa  # noqa: E402

pytestmark = pytest.mark.native_independent  # calls no topg op (docs/build.md)

if not ON_GPU and not tpa.INTERPRETED:
    # Imported earlier in this process without TRITON_INTERPRET: define the kernels again.
    from torch_topg.triton_kernels import paged_attention_kernels

    importlib.reload(paged_attention_kernels)
    tpa = importlib.reload(tpa)

if ON_GPU and not torch.cuda.is_available():
    pytest.skip("TOPG_TRITON_TEST_CUDA=1 needs a CUDA device", allow_module_level=True)
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
BF16_SKIP = "bf16 tl.dot is wrong under the Triton interpreter (checked on a GPU instead)"


def _paged(lens, hq, hkv, d, block_size, dtype, *, quant=False, spare_blocks=3, q_rows=None):
    """Caches with shuffled block tables for sequences ``lens`` (as in
    tests/test_paged_attention.py), on DEVICE; int8 caches with their scales if ``quant``.
    Returns (q, key_cache, value_cache, block_tables, seq_lens, kv_scales)."""
    max_blocks = max([1, *(-(-n // block_size) for n in lens)]) + 1
    num_blocks = len(lens) * max_blocks + spare_blocks
    kc = torch.randn(num_blocks, block_size, hkv, d)
    vc = torch.randn(num_blocks, block_size, hkv, d)
    scales = {}
    if quant:
        (kc, ks), (vc, vs) = reference.quantize_kv(kc), reference.quantize_kv(vc)
        scales = {"key_scale": ks.to(DEVICE), "value_scale": vs.to(DEVICE)}
    else:
        kc, vc = kc.to(dtype), vc.to(dtype)
    perm = torch.randperm(num_blocks)[: len(lens) * max_blocks]
    block_tables = perm.view(len(lens), max_blocks).int()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens) if q_rows is None else q_rows, hq, d).to(dtype)
    dev = [t.to(DEVICE) for t in (q, kc, vc, block_tables, seq_lens)]
    return (*dev, scales)


def _cu(q_lens) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=DEVICE)


def _compare(q, kc, vc, bt, sl, config=None, **kw):
    out = tpa.paged_attention(q, kc, vc, bt, sl, config=config, **kw)
    ref = reference.paged_attention(q, kc, vc, bt, sl, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref)
    return out


# Partitions of 16 keys, at most 3 a row (longer rows: multiples of 16), 2 programs a row:
# the split path and its merge at the lengths the interpreter can afford.
SPLIT = {"split_keys": 16, "max_splits": 3, "num_splits": 2}
HEADS = [(2, 2), (4, 1), (8, 1), (8, 2)]  # GQA ratios 1, 4, 8, 4


@given(
    lens=st.lists(st.sampled_from([0, 1, 5, 16, 17, 40, 70, 300]), min_size=1, max_size=3),
    heads=st.sampled_from(HEADS),
    d=st.sampled_from([20, 64, 80, 128]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 7]),
    softcap=st.sampled_from([0.0, 0.0, 5.0]),
    scale=st.sampled_from([None, 0.2]),
    quant=st.booleans(),
    config=st.sampled_from([None, SPLIT]),
)
@example([1, 0, 17], (8, 1), 80, 16, torch.float16, -1, 0.0, None, False, None)
@example([300, 1], (8, 2), 64, 16, torch.float16, -1, 0.0, None, False, None)  # 2 partitions
@example([70, 5], (4, 1), 20, 1, torch.float32, 7, 5.0, 0.2, True, SPLIT)
@example([40], (8, 2), 128, 32, torch.float16, -1, 5.0, None, True, SPLIT)
def test_decode(lens, heads, d, block_size, dtype, window, softcap, scale, quant, config):
    hq, hkv = heads
    q, kc, vc, bt, sl, scales = _paged(lens, hq, hkv, d, block_size, dtype, quant=quant)
    kw = dict(scale=scale, window_left=window, softcap=softcap, **scales)
    out = _compare(q, kc, vc, bt, sl, config, **kw)
    for s, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))


def _q_len(n: int, kind: str) -> int:
    return {"zero": 0, "one": min(n, 1), "few": min(n, 5), "all": n}[kind]


@given(
    seqs=st.lists(
        st.tuples(
            st.sampled_from([0, 1, 5, 16, 17, 40, 130]),
            st.sampled_from(["zero", "one", "few", "all"]),
        ),
        min_size=1,
        max_size=3,
    ),
    heads=st.sampled_from(HEADS),
    d=st.sampled_from([20, 64, 80, 128]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 7]),
    softcap=st.sampled_from([0.0, 0.0, 5.0]),
    scale=st.sampled_from([None, 0.2]),
    quant=st.booleans(),
    block_m=st.sampled_from([16, 64]),
)
@example([(40, "all"), (17, "few"), (0, "zero")], (8, 2), 64, 16, torch.float16, -1, 0.0,
         None, False, 64)  # fmt: skip
@example([(130, "all"), (5, "one")], (4, 1), 80, 32, torch.float32, 7, 5.0, 0.2, True, 16)
@example([(17, "few"), (40, "zero")], (2, 2), 20, 1, torch.float16, 0, 0.0, None, True, 16)
def test_multi_query(seqs, heads, d, block_size, dtype, window, softcap, scale, quant, block_m):
    # A prefill chunk / speculative tokens: the last q_len tokens of each sequence, causal
    # bottom-right among themselves (q_len == seq_len: the whole prompt).
    hq, hkv = heads
    lens = [n for n, _ in seqs]
    q_lens = [_q_len(n, kind) for n, kind in seqs]
    q, kc, vc, bt, sl, scales = _paged(
        lens, hq, hkv, d, block_size, dtype, quant=quant, q_rows=sum(q_lens)
    )
    kw = dict(cu_seqlens_q=_cu(q_lens), scale=scale, window_left=window, softcap=softcap)
    _compare(q, kc, vc, bt, sl, {"multi_block_m": block_m}, **kw, **scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_every_dtype(dtype):
    if dtype == torch.bfloat16 and not ON_GPU:
        pytest.skip(BF16_SKIP)
    q, kc, vc, bt, sl, _ = _paged([1, 33, 0], 8, 2, 64, 16, dtype)
    _compare(q, kc, vc, bt, sl, window_left=20, softcap=5.0)
    _compare(q, kc, vc, bt, sl, SPLIT)
    rq = torch.randn(9, 8, 64, device=DEVICE).to(dtype)
    _compare(rq, kc, vc, bt, sl, cu_seqlens_q=_cu([1, 8, 0]))


@pytest.mark.parametrize("ragged", [False, True])
def test_empty_batch(ragged):
    q, kc, vc, bt, sl, _ = _paged([], 4, 2, 32, 16, torch.float32)
    kw = {"cu_seqlens_q": _cu([])} if ragged else {}
    out = tpa.paged_attention(q, kc, vc, bt, sl, **kw)
    assert out.shape == (0, 4, 32)


def test_no_query_rows():
    # Sequences with cached tokens but no new ones: an empty result.
    _, kc, vc, bt, sl, _ = _paged([5, 20], 4, 2, 32, 16, torch.float32)
    q = torch.randn(0, 4, 32, device=DEVICE)
    assert tpa.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=_cu([0, 0])).shape == q.shape


def test_one_token_rows_match_decode():
    # Each sequence's last token as a ragged row of length 1 == its decode (within
    # tolerance: the two kernels sum in different orders).
    q, kc, vc, bt, sl, _ = _paged([1, 40, 17], 8, 2, 64, 16, torch.float32)
    decode = tpa.paged_attention(q, kc, vc, bt, sl, config=SPLIT, window_left=9)
    ragged = tpa.paged_attention(q, kc, vc, bt, sl, cu_seqlens_q=_cu([1, 1, 1]), window_left=9)
    assert_close(ragged, decode)


def test_decode_batch_invariant():
    # Bitwise: a sequence alone == in a batch, whatever the split programs, and a row
    # with one partition gives the same bits from the direct path (a table with one
    # partition slot) as from the merge.
    cfg = {"split_keys": 16, "max_splits": 3}
    q, kc, vc, bt, sl, _ = _paged([70, 5, 33, 1, 16], 4, 1, 64, 16, torch.float32)
    batch = tpa.paged_attention(q, kc, vc, bt, sl, config={**cfg, "num_splits": 1})
    for num_splits in (2, 3):
        again = tpa.paged_attention(q, kc, vc, bt, sl, config={**cfg, "num_splits": num_splits})
        assert torch.equal(again, batch)
    alone = tpa.paged_attention(q[:1], kc, vc, bt[:1], sl[:1], config=cfg)
    assert torch.equal(alone, batch[:1])
    # 16 tokens in a 16-token table (one slot: direct) and in the batch's wider table.
    direct = tpa.paged_attention(q[4:], kc, vc, bt[4:, :1], sl[4:], config=cfg)
    assert torch.equal(direct, batch[4:])
    # Scratch for one sequence at a time: a launch per sequence.
    chunked = tpa.paged_attention(q, kc, vc, bt, sl, config={**cfg, "scratch_bytes": 1})
    assert torch.equal(chunked, batch)


def test_strided_query():
    # Only the last dimension of the query must be contiguous.
    _, kc, vc, bt, sl, _ = _paged([17, 40], 8, 2, 64, 16, torch.float32)
    q = torch.randn(8, 2, 64, device=DEVICE).transpose(0, 1)  # [Hq, num_seqs] storage
    _compare(q, kc, vc, bt, sl, SPLIT)
    rq = torch.randn(8, 9, 64, device=DEVICE).transpose(0, 1)
    _compare(rq, kc, vc, bt, sl, cu_seqlens_q=_cu([4, 5]), window_left=3)


def test_quantised_matches_dequantised_cache():
    # int8 caches == the same attention over their dequantised values (fp32).
    q, kc, vc, bt, sl, sc = _paged([17, 40], 8, 2, 80, 16, torch.float32, quant=True)
    kf = reference.dequantize_kv(kc, sc["key_scale"])
    vf = reference.dequantize_kv(vc, sc["value_scale"])
    for config in (None, SPLIT):
        out = tpa.paged_attention(q, kc, vc, bt, sl, config=config, **sc)
        assert_close(out, reference.paged_attention(q, kf, vf, bt, sl))


# --- supports, argument and value checks ----------------------------------------------


def test_supports_reasons():
    q, kc, vc, bt, sl, _ = _paged([5, 20], 4, 2, 32, 16, torch.float32)
    assert tpa.supports(q, kc, vc, bt, sl) is None
    half = tpa.supports(q.half(), kc.half(), vc.half(), bt, sl)
    assert half is None
    bf = tpa.supports(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), bt, sl)
    if ON_GPU:
        assert bf is None
    else:
        assert "bfloat16" in bf and "interpreter" in bf
        with pytest.raises(RuntimeError, match="cannot take this call: bfloat16 under"):
            tpa.paged_attention(q.bfloat16(), kc.bfloat16(), vc.bfloat16(), bt, sl)
    assert tpa.supports(q.double(), kc.double(), vc.double(), bt, sl) == "dtype float64"
    big = torch.randn(2, 4, 300, device=DEVICE)
    kbig = torch.randn(*kc.shape[:3], 300, device=DEVICE)
    assert tpa.supports(big, kbig, kbig, bt, sl) == "head_dim 300 > 256"
    assert tpa.supports(q, kc.half(), vc.half(), bt, sl) == "key_cache dtype float16"
    sinks = torch.zeros(4, device=DEVICE)
    assert "attention sinks" in tpa.supports(q, kc, vc, bt, sl, sinks=sinks)
    with pytest.raises(RuntimeError, match="cannot take this call: attention sinks"):
        tpa.paged_attention(q, kc, vc, bt, sl, sinks=sinks)


@pytest.mark.skipif(ON_GPU, reason="the kernels are compiled for CUDA here")
def test_supports_cpu_needs_the_interpreter(monkeypatch):
    q, kc, vc, bt, sl, _ = _paged([5], 4, 2, 32, 16, torch.float32)
    monkeypatch.setattr(tpa, "INTERPRETED", False)
    assert tpa.supports(q, kc, vc, bt, sl) == (
        "device cpu without TRITON_INTERPRET=1 (set before triton is imported)"
    )


def test_decode_num_splits():
    # One long sequence: as many programs as partition slots; a big batch: one.
    assert tpa.decode_num_splits(32768, 1, 8, target_programs=528) == 16
    assert tpa.decode_num_splits(4096, 1, 8, target_programs=528) == 16
    assert tpa.decode_num_splits(1024, 1, 8, target_programs=528) == 4
    assert tpa.decode_num_splits(32768, 8, 8, target_programs=528) == 9
    assert tpa.decode_num_splits(32768, 256, 8, target_programs=528) == 1
    assert tpa.decode_num_splits(16, 1, 1, target_programs=528) == 1


_q, _kc, _vc, _bt, _sl, _ = _paged([5, 20], 4, 2, 32, 16, torch.float32)
_rq = torch.randn(7, 4, 32, device=DEVICE)  # ragged: 2 new tokens of sequence 0, 5 of 1
_ok_cu = _cu([2, 5])
_i8 = _kc.to(torch.int8)
_scale = torch.ones(_kc.shape[:3], device=DEVICE)


@pytest.mark.parametrize(
    "args, kw, match",
    [
        ((_q.half(), _kc, _vc, _bt, _sl), {}, "argument 'key_cache'.*expected dtype float16"),
        ((_q[:, :3], _kc, _vc, _bt, _sl), {}, "multiple of key/value"),
        ((_q[0], _kc, _vc, _bt, _sl), {}, "argument 'query'.*expected 3 dimensions"),
        ((_q, _kc[..., :16], _vc[..., :16], _bt, _sl), {}, "argument 'key_cache'.*head_dim"),
        ((_q, _kc, _vc[:, :8], _bt, _sl), {}, "argument 'value_cache'"),
        ((_q, _kc, _vc, _bt.long(), _sl), {}, "argument 'block_tables'.*int32"),
        ((_q, _kc, _vc, _bt, _sl[:1]), {}, "argument 'seq_lens'"),
        ((_q, _kc, _vc, _bt[0], _sl), {}, "argument 'block_tables'.*2 dimensions"),
        ((_rq, _kc, _vc, _bt, _sl), {"cu_seqlens_q": _ok_cu.long()}, "'cu_seqlens_q'.*int32"),
        ((_rq, _kc, _vc, _bt, _sl), {"cu_seqlens_q": _ok_cu[:2]}, "'cu_seqlens_q'.*size 3"),
        ((_rq, _kc, _vc, _bt[:1], _sl), {"cu_seqlens_q": _ok_cu}, "'block_tables'.*num_seqs"),
        ((_q, _kc, _vc, _bt, _sl), {"window_left": -2}, "window_left must be >= -1"),
        ((_q, _kc, _vc, _bt, _sl), {"softcap": -1.0}, "softcap must be >= 0"),
        ((_q, _i8, _i8, _bt, _sl), {}, "argument 'key_scale' expected a float32 tensor"),
        ((_q, _kc, _vc, _bt, _sl), {"key_scale": _scale}, "'key_scale'.*None with float32"),
        (
            (_q, _i8, _i8, _bt, _sl),
            {"key_scale": _scale, "value_scale": _scale[:1]},
            "argument 'value_scale'.*size 9 at dim 0",
        ),
        ((_q, _kc, _vc, _bt, _sl), {"config": {"bogus": 1}}, "config key 'bogus' unknown"),
        ((_q, _kc, _vc, _bt, _sl), {"config": {"decode_block_n": 24}}, "power of two"),
    ],
)
def test_bad_input(args, kw, match):
    with pytest.raises(RuntimeError, match="^topg::paged_attention: .*" + match):
        tpa.paged_attention(*args, **kw)


def _bad_values():
    bt_high, bt_neg = _bt.clone(), _bt.clone()
    bt_high[1, 1] = _kc.shape[0]  # used by sequence 1 (20 tokens = 2 blocks)
    bt_neg[1, 1] = -1
    too_long = torch.tensor([5, _bt.shape[1] * 16 + 1], dtype=torch.int32, device=DEVICE)
    sl = torch.tensor([5, 20], dtype=torch.int32, device=DEVICE)
    return [
        ((_q, _kc, _vc, bt_high, _sl), {}),
        ((_q, _kc, _vc, bt_neg, _sl), {}),
        ((_q, _kc, _vc, _bt, too_long), {}),
        ((_rq, _kc, _vc, bt_neg, _sl), {"cu_seqlens_q": _ok_cu}),
        ((torch.randn(7, 4, 32, device=DEVICE), _kc, _vc, _bt, sl), {"cu_seqlens_q": _cu([6, 1])}),
        *[
            ((_rq, _kc, _vc, _bt, _sl), {"cu_seqlens_q": torch.tensor(o, dtype=torch.int32)})
            for o in ([0, 5, 2], [1, 3, 7], [0, 2, 8], [-3, 2, 7])
        ],
    ]


@pytest.mark.parametrize("args, kw", _bad_values())
def test_bad_values_as_the_reference(args, kw):
    # The same error, word for word, as the reference's.
    if "cu_seqlens_q" in kw:
        kw = {"cu_seqlens_q": kw["cu_seqlens_q"].to(DEVICE)}
    with pytest.raises(RuntimeError) as ref:
        reference.paged_attention(*args, **kw)
    with pytest.raises(RuntimeError) as got:
        tpa.paged_attention(*args, check_indices=True, **kw)
    assert str(got.value) == str(ref.value)


def test_unused_block_ids_are_not_checked():
    bt = _bt.clone()
    bt[0, 1] = 10**6  # not used by sequence 0 (5 tokens = 1 block)
    out = tpa.paged_attention(_q, _kc, _vc, bt, _sl)
    assert_close(out, reference.paged_attention(_q, _kc, _vc, bt, _sl))
