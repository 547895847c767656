"""The Pallas kernels of csrc/tpu in interpret mode (JAX on the CPU) against the shared
references, with block sizes that do and do not divide the lengths.

Interpret mode compiles each (shape, block, flag) combination once (about a second), so
shapes are small and the example counts low; TOPG_HYPOTHESIS_PROFILE=thorough scales them.
"""

from __future__ import annotations

import functools

import pytest
import torch
from conftest import TOL, assert_close
from hypothesis import example, given, settings
from hypothesis import strategies as st

from torch_topg import reference

# the Pallas kernels against torch_topg.reference: the reference lane deselects it (docs/build.md)
pytestmark = pytest.mark.native_independent

jax = pytest.importorskip("jax")
pytest.importorskip("ml_dtypes")

import jax.numpy as jnp  # noqa: E402

from torch_topg.tpu import kernels  # noqa: E402
from torch_topg.tpu._bridge import to_numpy, to_torch  # noqa: E402
from torch_topg.tpu._pallas import gmm_metadata as gmm_metadata_torch  # noqa: E402

N = kernels("norm")
A = kernels("attention")
P = kernels("paged_attention")
M = kernels("moe")
DTYPES = [torch.float32, torch.bfloat16]


def _examples(n: int) -> settings:
    """n examples under the ci profile (12 examples), proportionally more otherwise."""
    return settings(max_examples=max(1, n * settings.default.max_examples // 12))


def _jit(fn, **static):  # type: ignore[no-untyped-def]
    """``fn`` with its static arguments bound, jitted whole: one compilation per example
    instead of one per eager jnp op (about a third faster in interpret mode)."""
    return jax.jit(functools.partial(fn, interpret=True, **static))


def J(t: torch.Tensor | None):  # type: ignore[no-untyped-def]
    return None if t is None else jnp.asarray(to_numpy(t))


def T(a) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return to_torch(a)


def _sinks(with_sinks: bool, hq: int) -> torch.Tensor | None:
    """float32 [hq] attention sinks (one -inf: no sink for that head), or None."""
    if not with_sinks:
        return None
    s = torch.randn(hq) * 2
    s[0] = float("-inf")
    return s


# --- norms ---------------------------------------------------------------------------
@_examples(3)
@given(
    rows=st.sampled_from([1, 5, 16, 33]),
    hidden=st.sampled_from([8, 40, 128]),
    dtype=st.sampled_from(DTYPES),
    block_rows=st.sampled_from([8, 16, 256]),
    fused=st.booleans(),
)
@example(33, 40, torch.bfloat16, 16, True)  # 16 does not divide 33 rows
@example(5, 128, torch.float32, 8, False)
def test_rms_norm(rows, hidden, dtype, block_rows, fused):
    x = torch.randn(rows, hidden, dtype=dtype)
    w = torch.randn(hidden, dtype=dtype)
    if not fused:
        out = T(N.rms_norm(J(x), J(w), 1e-5, block_rows=block_rows, interpret=True))
        assert out.dtype == dtype
        assert_close(out, reference.rms_norm(x, w, 1e-5))
        return
    res = torch.randn(rows, hidden, dtype=dtype)
    out, new_res = N.fused_add_rms_norm(
        J(x), J(res), J(w), 1e-5, block_rows=block_rows, interpret=True
    )
    x_ref, res_ref = x.clone(), res.clone()
    reference.fused_add_rms_norm(x_ref, res_ref, w, 1e-5)
    assert torch.equal(T(new_res), res_ref)  # the rounded sum, exactly
    assert_close(T(out), x_ref)


# --- prefill attention ---------------------------------------------------------------
@_examples(4)
@given(
    b=st.integers(1, 2),
    sq=st.sampled_from([1, 7, 16, 23]),
    extra_k=st.sampled_from([0, 0, 5, 17]),
    heads=st.sampled_from([(2, 1), (4, 2), (2, 2), (3, 1)]),
    d=st.sampled_from([16, 20, 32]),
    dtype=st.sampled_from(DTYPES),
    causal=st.booleans(),
    window=st.sampled_from([-1, -1, 0, 6]),
    softcap=st.sampled_from([0.0, 0.0, 5.0]),
    scale=st.sampled_from([None, 0.3]),
    blocks=st.sampled_from([(8, 8), (16, 8), (8, 16), (128, 128)]),
    sinks=st.booleans(),
)
@example(1, 23, 17, (4, 2), 20, torch.float32, True, 6, 5.0, 0.3, (8, 16), True)  # partial blocks
@example(2, 16, 0, (2, 2), 32, torch.bfloat16, True, -1, 0.0, None, (8, 8), False)  # blocks divide
@example(1, 7, 5, (3, 1), 16, torch.float32, False, 0, 0.0, None, (8, 8), False)
def test_attention(b, sq, extra_k, heads, d, dtype, causal, window, softcap, scale, blocks, sinks):
    hq, hkv = heads
    sk = sq + extra_k
    q = torch.randn(b, sq, hq, d, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, dtype=dtype)
    v = torch.randn(b, sk, hkv, d, dtype=dtype)
    kw = dict(causal=causal, window_left=window, softcap=softcap, scale=scale)
    sk_ = _sinks(sinks, hq)
    fn = _jit(A.attention, block_q=blocks[0], block_k=blocks[1], **kw)
    out = fn(J(q), J(k), J(v), sinks=J(sk_))
    assert out.shape == q.shape and T(out).dtype == dtype
    assert_close(T(out), reference.attention(q, k, v, sinks=sk_, **kw))


def test_attention_more_queries_than_keys():
    # Bottom-right causal with Sq > Sk: the first Sq - Sk queries see nothing -> zeros.
    q, k, v = torch.randn(1, 20, 2, 16), torch.randn(1, 9, 2, 16), torch.randn(1, 9, 2, 16)
    out = T(A.attention(J(q), J(k), J(v), causal=True, block_q=8, block_k=8, interpret=True))
    assert torch.equal(out[0, :11], torch.zeros_like(out[0, :11]))
    assert_close(out, reference.attention(q, k, v, causal=True))


# --- paged decode attention ----------------------------------------------------------
def _paged(lens, hq, hkv, d, page, dtype):  # type: ignore[no-untyped-def]
    max_pages = max(1, max(-(-n // page) for n in lens)) + 1
    num_blocks = len(lens) * max_pages + 2
    kc = torch.randn(num_blocks, page, hkv, d, dtype=dtype)
    vc = torch.randn(num_blocks, page, hkv, d, dtype=dtype)
    bt = torch.randperm(num_blocks)[: len(lens) * max_pages].view(len(lens), max_pages).int()
    return torch.randn(len(lens), hq, d, dtype=dtype), kc, vc, bt, torch.tensor(lens).int()


@_examples(4)
@given(
    lens=st.lists(st.sampled_from([0, 1, 7, 16, 17, 40]), min_size=1, max_size=3),
    heads=st.sampled_from([(4, 2), (2, 2), (3, 1), (8, 1)]),
    d=st.sampled_from([16, 20, 32]),
    page=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([-1, -1, 0, 9]),
    softcap=st.sampled_from([0.0, 0.0, 5.0]),
    scale=st.sampled_from([None, 0.3]),
    pages_per_step=st.sampled_from([None, 1, 3]),
    sinks=st.booleans(),
)
@example([17, 0, 40], (4, 2), 20, 4, torch.float32, 9, 5.0, 0.3, 3, True)  # 3 does not divide pages
@example([16, 1], (8, 1), 32, 16, torch.bfloat16, -1, 0.0, None, None, False)
@example([40], (2, 2), 16, 1, torch.float32, 0, 0.0, None, None, False)  # page size 1
def test_paged_attention(
    lens, heads, d, page, dtype, window, softcap, scale, pages_per_step, sinks
):
    q, kc, vc, bt, sl = _paged(lens, heads[0], heads[1], d, page, dtype)
    kw = dict(scale=scale, window_left=window, softcap=softcap)
    sk_ = _sinks(sinks, heads[0])
    fn = _jit(P.paged_attention, pages_per_step=pages_per_step, **kw)
    out = T(fn(J(q), J(kc), J(vc), J(bt), J(sl), sinks=J(sk_)))
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, reference.paged_attention(q, kc, vc, bt, sl, sinks=sk_, **kw))
    for s, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))


def test_paged_attention_ignores_unused_table_entries():
    # Entries past a sequence's pages may hold anything (here out-of-range ids).
    q, kc, vc, bt, sl = _paged([5, 0], 2, 1, 16, 4, torch.float32)
    bt[0, 2:] = 10_000
    bt[1, :] = -7
    out = T(P.paged_attention(J(q), J(kc), J(vc), J(bt), J(sl), interpret=True))
    assert_close(out, reference.paged_attention(q, kc, vc, bt, sl))


# --- MoE ------------------------------------------------------------------------------
@_examples(4)
@given(
    tokens=st.sampled_from([1, 5, 13, 40]),
    experts_k=st.sampled_from([(4, 1), (8, 2), (60, 4), (8, 8)]),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    bias=st.booleans(),
    ties=st.booleans(),
    block_tokens=st.sampled_from([8, 16, 256]),
)
@example(13, (8, 2), "softmax", True, False, True, 8)  # ties go to the lower expert id
@example(40, (60, 4), "sigmoid", True, True, False, 16)  # DeepSeek-style bias
def test_moe_topk(tokens, experts_k, scoring, renormalize, bias, ties, block_tokens):
    e, k = experts_k
    logits = torch.randint(-2, 3, (tokens, e)).float() if ties else torch.randn(tokens, e)
    cb = torch.randn(e) if bias else None
    kw = dict(scoring=scoring, renormalize=renormalize)
    fn = _jit(M.moe_topk, top_k=k, block_tokens=block_tokens, **kw)
    w, ids = fn(J(logits), correction_bias=J(cb))
    rw, rids = reference.moe_topk(logits, k, correction_bias=cb, **kw)
    assert torch.equal(T(ids), rids)
    assert_close(T(w), rw)


@_examples(2)
@given(
    tokens=st.sampled_from([1, 5, 9]),
    hidden=st.sampled_from([16, 24]),
    inter=st.sampled_from([8, 20]),
    experts_k=st.sampled_from([(3, 1), (8, 2), (4, 3)]),
    activation=st.sampled_from(["silu", "gelu", "gelu_tanh"]),
    dtype=st.sampled_from(DTYPES),
    blocks=st.sampled_from([(8, 8, 8), (16, 8, 16), (128, 128, 512)]),
)
@example(9, 24, 20, (4, 3), "silu", torch.float32, (8, 8, 16))  # tiles split experts and K
@example(5, 16, 8, (8, 2), "gelu_tanh", torch.bfloat16, (16, 8, 8))
def test_fused_moe(tokens, hidden, inter, experts_k, activation, dtype, blocks):
    e, k = experts_k
    x = torch.randn(tokens, hidden, dtype=dtype)
    wgu = (torch.randn(e, 2 * inter, hidden) * 0.3).to(dtype)
    wd = (torch.randn(e, hidden, inter) * 0.3).to(dtype)
    tw, ti = reference.moe_topk(torch.randn(tokens, e), k, renormalize=True)
    bm, bn, bk = blocks
    fn = _jit(M.fused_moe, activation=activation, block_m=bm, block_n=bn, block_k=bk)
    out = fn(J(x), J(wgu), J(wd), J(tw), J(ti))
    ref = reference.fused_moe(x, wgu, wd, tw, ti, activation=activation)
    assert T(out).dtype == dtype
    assert_close(T(out), ref, scale=2.0)


def _visits(sizes: list[int], block_m: int) -> list[tuple[int, int]]:
    """(group, row tile) for every tile a group's rows touch, in order."""
    want, start = [], 0
    for e, n in enumerate(sizes):
        if n:
            want += [(e, t) for t in range(start // block_m, (start + n - 1) // block_m + 1)]
        start += n
    return want


@settings(max_examples=40)
@given(sizes=st.lists(st.integers(0, 20), min_size=1, max_size=8), block_m=st.sampled_from([8, 16]))
def test_gmm_metadata_torch(sizes, block_m):
    # Every (row tile, group) overlap is visited exactly once, in order (torch side, cheap).
    rows = max(1, sum(sizes))
    gid, tid, nv, _, ends = gmm_metadata_torch(torch.tensor(sizes).int(), rows, block_m)
    want = _visits(sizes, block_m)
    assert int(nv[0]) == len(want) and len(gid) == -(-rows // block_m) + len(sizes) - 1
    assert list(zip(gid.tolist(), tid.tolist(), strict=True))[: len(want)] == want
    assert ends.tolist() == torch.tensor(sizes).cumsum(0).tolist()


@pytest.mark.parametrize("sizes", [[0, 5, 0, 17, 3, 0], [40], [0, 0, 1]])
def test_gmm_metadata_jax_matches_torch(sizes):
    g = torch.tensor(sizes, dtype=torch.int32)
    rows = max(1, sum(sizes))
    got = [T(a) for a in M.gmm_metadata(J(g), rows, 8, len(sizes))]
    want = gmm_metadata_torch(g, rows, 8)[:3]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert list(zip(got[0].tolist(), got[1].tolist(), strict=True))[: int(got[2][0])] == _visits(
        sizes, 8
    )


# --- lowering for TPU, and bad input ----------------------------------------------------
def test_kernels_lower_to_mosaic_for_tpu():
    # JAX lowers each kernel for the TPU platform from the CPU: Pallas's TPU lowering (block
    # shapes, index maps, ops used) runs; the Mosaic compile itself needs libtpu (not here).
    S, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
    cases = [
        (N.rms_norm_kernel, [S((512, 4096), bf), S((1, 4096), bf)], dict(epsilon=1e-6)),
        (A.attention_kernel, [S((1, 8, 1000, 128), bf), S((1, 2, 1000, 128), bf)] * 1
         + [S((1, 2, 1000, 128), bf)], dict(causal=True, window_left=300, softcap=30.0)),
        (P.paged_attention_call, [S((4, 64), i32), S((4,), i32), S((4, 32, 128), bf)]
         + [S((1000, 16, 8, 128), bf)] * 16, dict(window_left=-1)),
        (M.moe_topk_kernel, [S((300, 64), jnp.float32)], dict(top_k=8)),
        (M.gmm_call, [S((20,), i32)] * 2 + [S((1,), i32)] + [S((8,), i32)] * 2
         + [S((1536, 1024), bf)] + [S((8, 2816, 1024), bf)] * 2,
         dict(activation="silu", bm=128, bn=128, bk=512)),
    ]  # fmt: skip
    for fn, args, static in cases:
        lowered = jax.jit(fn, static_argnames=tuple(static)).trace(*args, **static)
        text = lowered.lower(lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text, fn.__name__


def test_bad_input_names_the_argument():
    x = J(torch.randn(4, 8))
    with pytest.raises(ValueError, match="'block_rows'"):
        N.rms_norm(x, J(torch.randn(8)), block_rows=12, interpret=True)
    with pytest.raises(ValueError, match="'weight'"):
        N.rms_norm(x, J(torch.randn(7)), interpret=True)
    q, k = J(torch.randn(1, 4, 3, 16)), J(torch.randn(1, 4, 2, 16))
    with pytest.raises(ValueError, match="'key'"):
        A.attention(q, k, k, interpret=True)
    with pytest.raises(ValueError, match="'block_k'"):
        A.attention(q, q, q, block_k=0, interpret=True)
    q, kc, vc, bt, sl = (J(t) for t in _paged([3], 2, 1, 16, 4, torch.float32))
    with pytest.raises(ValueError, match="'pages_per_step'"):
        P.paged_attention(q, kc, vc, bt, sl, pages_per_step=0, interpret=True)
    with pytest.raises(ValueError, match="'seq_lens'"):
        P.paged_attention(q, kc, vc, bt, J(torch.tensor([1, 2]).int()), interpret=True)
    with pytest.raises(ValueError, match="'top_k'"):
        M.moe_topk(J(torch.randn(3, 4)), 5, interpret=True)
    with pytest.raises(ValueError, match="'w_down'"):
        M.fused_moe(
            J(torch.randn(2, 8)), J(torch.randn(2, 6, 8)), J(torch.randn(2, 8, 2)),
            J(torch.ones(2, 1)), J(torch.zeros(2, 1).int()), interpret=True,
        )  # fmt: skip


assert set(DTYPES) <= set(TOL)
