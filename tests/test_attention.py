"""attention (prefill) against its reference: dense, ragged, GQA, masks, windows."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, assert_close, requires_kernel
from hypothesis import example, given
from hypothesis import strategies as st

import torch_topg
from torch_topg import reference

LENGTHS = st.sampled_from([1, 2, 17, 63, 64, 65, 100, 129])
HEADS = st.sampled_from([(1, 1), (2, 2), (4, 2), (8, 2), (6, 1), (4, 4)])  # (Hq, Hkv)
HEAD_DIMS = st.sampled_from([32, 64, 80, 128, 20])
#: attention sinks: none, around the scores, or large enough to take most of the mass
SINKS = st.sampled_from(["none", "none", "randn", "large"])


def _sinks(kind: str, hq: int) -> torch.Tensor | None:
    """float32 [hq] sinks of a kind (see SINKS); one head's is -inf (no effect)."""
    if kind == "none":
        return None
    s = torch.randn(hq) * 2 if kind == "randn" else torch.full((hq,), 6.0)
    s[0] = float("-inf")
    return s


def _qkv(b, sq, sk, hq, hkv, d, dtype, transposed=False):
    if transposed:  # Hugging Face layout [B, H, S, D] seen as [B, S, H, D]: no copy
        q = torch.randn(b, hq, sq, d, dtype=dtype).transpose(1, 2)
        k = torch.randn(b, hkv, sk, d, dtype=dtype).transpose(1, 2)
        v = torch.randn(b, hkv, sk, d, dtype=dtype).transpose(1, 2)
        return q, k, v
    return (
        torch.randn(b, sq, hq, d, dtype=dtype),
        torch.randn(b, sk, hkv, d, dtype=dtype),
        torch.randn(b, sk, hkv, d, dtype=dtype),
    )


@requires_kernel("attention")
@given(
    b=st.integers(1, 2),
    sq=LENGTHS,
    extra_k=st.sampled_from([0, 0, 3, 40]),
    heads=HEADS,
    d=HEAD_DIMS,
    dtype=st.sampled_from(DTYPES),
    causal=st.booleans(),
    window=st.sampled_from([-1, -1, 0, 7, 50]),
    softcap=st.sampled_from([0.0, 0.0, 5.0]),
    scale=st.sampled_from([None, 0.3]),
    transposed=st.booleans(),
    sinks=SINKS,
)
@example(1, 65, 0, (8, 2), 128, torch.bfloat16, True, -1, 0.0, None, True, "none")
@example(2, 17, 40, (4, 1), 80, torch.float16, True, 7, 5.0, 0.3, False, "randn")
@example(1, 1, 0, (2, 2), 64, torch.float32, False, -1, 0.0, None, False, "large")
@example(1, 129, 0, (6, 1), 32, torch.float32, True, 0, 0.0, None, False, "randn")
def test_attention(
    b, sq, extra_k, heads, d, dtype, causal, window, softcap, scale, transposed, sinks
):
    hq, hkv = heads
    sk = sq + extra_k
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, dtype, transposed)
    kw = dict(causal=causal, window_left=window, softcap=softcap, scale=scale,
              sinks=_sinks(sinks, hq))  # fmt: skip
    out = torch_topg.ops.attention(q, k, v, **kw)
    assert out.is_contiguous() and out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.attention(q, k, v, **kw))


@requires_kernel("attention")
def test_attention_causal_more_queries_than_keys():
    # Bottom-right alignment: the first Sq - Sk queries see nothing and output zeros.
    q, k, v = _qkv(1, 20, 8, 4, 2, 64, torch.float32)
    out = torch_topg.ops.attention(q, k, v, causal=True)
    assert_close(out, reference.attention(q, k, v, causal=True))
    assert torch.equal(out[:, :12], torch.zeros_like(out[:, :12]))


@requires_kernel("attention")
@given(
    lengths=st.lists(st.sampled_from([0, 1, 17, 63, 65, 129]), min_size=1, max_size=4),
    extra=st.lists(st.sampled_from([0, 5]), min_size=4, max_size=4),
    heads=HEADS,
    dtype=st.sampled_from(DTYPES),
    causal=st.booleans(),
    window=st.sampled_from([-1, 9]),
    separate_k=st.booleans(),
    sinks=SINKS,
)
@example([1, 65, 17], [0, 5, 0, 0], (8, 2), torch.bfloat16, True, -1, True, "none")
@example([0, 65, 17], [0, 5, 0, 0], (8, 2), torch.float32, True, 9, True, "randn")
def test_attention_ragged(lengths, extra, heads, dtype, causal, window, separate_k, sinks):
    hq, hkv = heads
    d = 64
    lk = [n + e for n, e in zip(lengths, extra, strict=False)] if separate_k else lengths
    cu_q = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lk).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), hq, d, dtype=dtype)
    k = torch.randn(int(cu_k[-1]), hkv, d, dtype=dtype)
    v = torch.randn(int(cu_k[-1]), hkv, d, dtype=dtype)
    kw = dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k if separate_k else None,
        causal=causal,
        window_left=window,
        sinks=_sinks(sinks, hq),
    )
    assert_close(torch_topg.ops.attention(q, k, v, **kw), reference.attention(q, k, v, **kw))


@requires_kernel("attention")
@pytest.mark.parametrize("kind", ["bool", "additive", "additive_bf16", "per_head"])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_mask(kind, causal):
    b, sq, sk, hq, hkv, d = 2, 33, 70, 4, 2, 64
    q, k, v = _qkv(b, sq, sk, hq, hkv, d, torch.float32)
    if kind == "bool":  # HF padding mask [B, 1, Sq, Sk], with one fully masked row
        mask = torch.rand(b, 1, sq, sk) > 0.3
        mask[0, 0, 5] = False
    elif kind == "per_head":
        mask = torch.rand(hq, 1, sk) > 0.5
    else:
        mask = torch.randn(b, 1, 1, sk)
        mask[1, ..., :20] = float("-inf")
        if kind == "additive_bf16":
            q, k, v, mask = (t.bfloat16() for t in (q, k, v, mask))
    out = torch_topg.ops.attention(q, k, v, causal=causal, mask=mask)
    assert_close(out, reference.attention(q, k, v, causal=causal, mask=mask))
    assert not out.isnan().any()
    if kind == "bool":
        assert torch.equal(out[0, 5], torch.zeros_like(out[0, 5]))


@requires_kernel("attention")
def test_attention_long_sequence_memory():
    # S = 4096, one head: the S x S fp32 score matrix alone would be 64 MiB. The kernel
    # tiles keys (online softmax), so it must not allocate anything of that order.
    import resource

    s, d = 4096, 64
    q, k, v = _qkv(1, s, s, 1, 1, d, torch.float32)
    torch_topg.ops.attention(q[:, :64], k[:, :64], v[:, :64], causal=True)  # warm up
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    out = torch_topg.ops.attention(q, k, v, causal=True)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 32, f"peak RSS grew by {grown_mib:.0f} MiB"
    assert_close(out[0, -3:], reference.attention(q[:, -3:], k, v, causal=True)[0])


def test_attention_opcheck():
    q, k, v = _qkv(2, 9, 12, 4, 2, 32, torch.float32)
    op = torch.ops.topg.attention.default
    torch.library.opcheck(op, (q, k, v), {"causal": True, "window_left": 3})
    torch.library.opcheck(op, (q, k, v), {"mask": torch.rand(2, 1, 9, 12) > 0.5})
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    torch.library.opcheck(op, (q[0], k[0, :9], v[0, :9]), {"cu_seqlens_q": cu, "causal": True})
    torch.library.opcheck(op, (q, k, v), {"causal": True, "sinks": torch.randn(4)})


@pytest.mark.parametrize("sliding_window", [None, 5])
def test_sinks_reference_is_transformers_gpt_oss_attention(sliding_window):
    """The reference's sink term is the one transformers' GPT-OSS eager attention computes
    (the sink joins the softmax as a column and is dropped), and the kernel agrees."""
    from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

    torch.manual_seed(0)
    b, s, hq, hkv, d = 2, 11, 4, 2, 16
    q, k, v = (torch.randn(b, h, s, d) for h in (hq, hkv, hkv))  # [B, H, S, D]
    mod = torch.nn.Module()
    mod.sinks, mod.num_key_value_groups, mod.training = torch.randn(hq) * 2, hq // hkv, False
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    visible = j <= i
    if sliding_window:
        visible &= j > i - sliding_window
    mask = torch.zeros(s, s).masked_fill(~visible, float("-inf"))[None, None]
    want, _ = gpt_oss.eager_attention_forward(mod, q, k, v, mask, scaling=0.3)  # [B, S, H, D]
    kw = dict(causal=True, scale=0.3, sinks=mod.sinks)
    kw["window_left"] = sliding_window - 1 if sliding_window else -1
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    assert_close(reference.attention(qt, kt, vt, **kw), want)
    assert_close(torch_topg.ops.attention(qt, kt, vt, **kw), want)


_Q, _K = torch.randn(1, 4, 4, 16), torch.randn(1, 4, 2, 16)
_CU = torch.tensor([0, 4], dtype=torch.int32)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((_Q, _K.half(), _K.half()), {}, "argument 'key'.*expected dtype float32"),
        ((_Q, torch.randn(1, 4, 3, 16), torch.randn(1, 4, 3, 16)), {}, "multiple of key/value"),
        ((_Q[0], _K, _K), {}, "argument 'query'.*expected 4 dimensions"),
        ((_Q, _K[..., :8], _K[..., :8]), {}, "argument 'key'.*head_dim"),
        ((_Q, _K, _K[..., :8]), {}, "argument 'value'"),
        ((_Q, torch.randn(2, 4, 2, 16), torch.randn(2, 4, 2, 16)), {}, "argument 'key'.*batch"),
        ((_Q[0], _K[0], _K[0]), {"cu_seqlens_q": _CU.long()}, "'cu_seqlens_q'.*int32"),
        ((_Q[0], _K[0], _K[0]), {"cu_seqlens_q": _CU[None]}, "'cu_seqlens_q'.*1 dimensions"),
        (
            (_Q[0], _K[0], _K[0]),
            {"cu_seqlens_q": _CU, "cu_seqlens_k": torch.tensor([0, 2, 4], dtype=torch.int32)},
            "'cu_seqlens_k'.*expected size 2",
        ),
        (
            (_Q[0], _K[0], _K[0]),
            {"cu_seqlens_q": _CU, "mask": torch.ones(4, 4, dtype=torch.bool)},
            "argument 'mask'.*ragged",
        ),
        ((_Q, _K, _K), {"mask": torch.ones(3, 4, dtype=torch.bool)}, "argument 'mask'"),
        ((_Q, _K, _K), {"mask": torch.ones(4, 4, dtype=torch.int32)}, "argument 'mask'"),
        ((_Q, _K, _K), {"window_left": -2}, "window_left"),
    ],
)
def test_attention_bad_input(args, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        torch_topg.ops.attention(*args, **kwargs)
    with pytest.raises(RuntimeError, match=match):  # the fake kernel checks the same
        with torch._subclasses.FakeTensorMode() as mode:
            fake_kwargs = {
                n: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t
                for n, t in kwargs.items()
            }
            torch_topg.ops.attention(*(mode.from_tensor(a) for a in args), **fake_kwargs)


@pytest.mark.parametrize("cu", [[0, 5, 3], [1, 4], [0, 3]])
def test_attention_bad_cu_seqlens_values(cu):
    q = torch.randn(4, 2, 16)
    with pytest.raises(RuntimeError, match="argument 'cu_seqlens_q'.*non-decreasing"):
        torch_topg.ops.attention(q, q, q, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="argument 'cu_seqlens_q'.*non-decreasing"):
        reference.attention(q, q, q, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32))


def test_ragged_max_seqlen() -> None:
    """max_seqlen_q / max_seqlen_k (flash-attn's varlen arguments): the same result when
    they are at least the longest sequence, an error naming them when below it (on the
    native kernel where built, and on the reference), and refused for dense input."""
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 3, 10, 12], dtype=torch.int32)
    q, k, v = (torch.randn(12, 4, 16, generator=g) for _ in range(3))
    base = torch_topg.ops.attention(q, k, v, cu_seqlens_q=cu, causal=True)
    for mq, mk in ((7, 7), (9, None), (None, 30)):
        out = torch_topg.ops.attention(
            q, k, v, cu_seqlens_q=cu, causal=True, max_seqlen_q=mq, max_seqlen_k=mk
        )
        torch.testing.assert_close(out, base, rtol=0, atol=0)
    for fn in (torch_topg.ops.attention, reference.attention):
        with pytest.raises(RuntimeError, match=r"'max_seqlen_q' expected at least .*\(7\), got 6"):
            fn(q, k, v, cu_seqlens_q=cu, max_seqlen_q=6)
        with pytest.raises(RuntimeError, match=r"'max_seqlen_k' expected at least .*\(7\), got 2"):
            fn(q, k, v, cu_seqlens_q=cu, max_seqlen_k=2)
    with pytest.raises(RuntimeError, match="'max_seqlen_q' expected None without 'cu_seqlens_q'"):
        torch_topg.ops.attention(q[None], k[None], v[None], max_seqlen_q=12)
    with pytest.raises(RuntimeError, match="'max_seqlen_k' expected a value >= 0, got -1"):
        torch_topg.ops.attention(q, k, v, cu_seqlens_q=cu, max_seqlen_k=-1)


@pytest.mark.parametrize("offsets", [[], [0]])
def test_ragged_without_sequences_is_refused(offsets: list[int]) -> None:
    """cu_seqlens_q with no sequence for the tokens: refused from its shape alone (the
    CUDA binding must not launch a grid of -1 sequences or return uninitialised rows)."""
    q = torch.randn(5, 2, 8)
    cu = torch.tensor(offsets, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"'cu_seqlens_q'.*non-decreasing offsets from 0 to 5"):
        torch_topg.ops.attention(q, q, q, cu_seqlens_q=cu, max_seqlen_q=5)
