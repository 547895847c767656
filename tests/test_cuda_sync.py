"""The CUDA hot path has no host synchronisation: with the index checks off (the
default outside this suite, see torch_topg.set_index_checks) a decode step's ops run
under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising
call; with the checks on, the same bad index raises a clear error instead."""

from __future__ import annotations

import pytest
import torch
from conftest import NEEDS_CUDA

import torch_topg
from torch_topg import ops

pytestmark = NEEDS_CUDA


@pytest.fixture
def no_checks():
    prev = torch_topg.set_index_checks(False)
    yield
    torch_topg.set_index_checks(prev)


def _decode_inputs(dtype: torch.dtype = torch.bfloat16):
    dev = "cuda"
    T, hq, hkv, d, nb, bs = 4, 8, 2, 64, 16, 16
    q = torch.randn(T, hq * d, device=dev, dtype=dtype)
    k = torch.randn(T, hkv * d, device=dev, dtype=dtype)
    pos = torch.tensor([3, 17, 0, 40], device=dev)
    cache = torch.randn(64, d, device=dev, dtype=torch.float32)
    kc = torch.zeros(nb, bs, hkv, d, device=dev, dtype=dtype)
    vc = torch.zeros_like(kc)
    bt = torch.arange(T * 4, device=dev, dtype=torch.int32).view(T, 4) % nb
    sl = (pos + 1).to(torch.int32)
    slots = (bt[torch.arange(T, device=dev), pos // bs] * bs + pos % bs).long()
    return q, k, pos, cache, kc, vc, bt, sl, slots, (T, hq, hkv, d)


def test_cuda_decode_ops_do_not_synchronise(no_checks) -> None:
    q, k, pos, cache, kc, vc, bt, sl, slots, (T, hq, hkv, d) = _decode_inputs()
    logits = torch.randn(T, 8, device="cuda")
    x = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(8, 2 * 32, 64, device="cuda", dtype=torch.bfloat16)
    w2 = torch.randn(8, 64, 32, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ops.rotary_embedding(pos, q, k, d, cache, True)
        kv = k.view(T, hkv, d)
        ops.reshape_and_cache(kv, kv, kc, vc, slots)
        ops.paged_attention(q.view(T, hq, d), kc, vc, bt, sl)
        w, ids = ops.moe_topk(logits, 2)
        ops.fused_moe(x, w13, w2, w, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_cuda_bad_block_id_checked_only_when_asked(no_checks) -> None:
    q, _, _, _, kc, vc, bt, sl, _, (T, hq, _, d) = _decode_inputs()
    bad = bt.clone()
    bad[0, 0] = kc.shape[0] + 5
    out = ops.paged_attention(q.view(T, hq, d), kc, vc, bad, sl)  # bounded: no fault
    torch.cuda.synchronize()
    assert out.shape == (T, hq, d)
    with torch_topg.index_checks(), pytest.raises(RuntimeError, match="'block_tables'"):
        ops.paged_attention(q.view(T, hq, d), kc, vc, bad, sl)


def test_cuda_ragged_attention_with_max_seqlen_does_not_synchronise(no_checks) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    cu = torch.tensor([0, 5, 21, 30], dtype=torch.int32, device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(30, 4, 64, device="cuda", dtype=dtype, generator=g) for _ in "qkv")
        want = torch_topg.reference.attention(q, k, v, cu_seqlens_q=cu, causal=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = ops.attention(q, k, v, cu_seqlens_q=cu, causal=True, max_seqlen_q=16)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.bool])
def test_cuda_attention_mask_in_its_own_dtype(dtype: torch.dtype) -> None:
    """The mask is read in its dtype through a broadcast view (no fp32 copy), including a
    mask whose key stride is neither 0 nor 1."""
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (
        torch.randn(2, 9, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qkv"
    )
    full = torch.randn(2, 1, 9, 18, device="cuda", generator=g)
    mask = (full > 0) if dtype == torch.bool else full.to(dtype)
    mask = mask[..., ::2]  # key stride 2
    want = torch_topg.reference.attention(q, k, v, mask=mask)
    got = ops.attention(q, k, v, mask=mask)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_cuda_paged_attention_without_blocks_gives_zeros(no_checks) -> None:
    q = torch.randn(2, 4, 64, device="cuda")
    kc = torch.zeros(0, 16, 2, 64, device="cuda")
    bt = torch.zeros(2, 1, dtype=torch.int32, device="cuda")
    sl = torch.tensor([3, 0], dtype=torch.int32, device="cuda")
    out = ops.paged_attention(q, kc, kc, bt, sl)
    torch.cuda.synchronize()
    assert torch.equal(out, torch.zeros_like(out))
