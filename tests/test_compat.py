"""torch_topg.compat.vllm / .sglang against references written from vLLM's and
sgl-kernel's documented semantics (layouts, in-place updates, block tables)."""

from __future__ import annotations

import enum
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import TOL

from torch_topg.compat import sglang, vllm


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def close(a: torch.Tensor, b: torch.Tensor, scale: float = 2.0) -> None:
    atol, rtol = TOL[b.dtype] if b.dtype in TOL else TOL[torch.float32]
    torch.testing.assert_close(a, b, atol=atol * scale, rtol=rtol * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms(dtype):
    x, r = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    w = torch.randn(64).to(dtype)
    out = torch.empty_like(x)
    vllm.rms_norm(out, x, w, 1e-5)
    close(out, rms(x, w, 1e-5))
    close(sglang.rmsnorm(x, w, 1e-5), rms(x, w, 1e-5))
    close(sglang.gemma_rmsnorm(x, w, 1e-5), rms(x, w.float() + 1, 1e-5))
    for fn in (vllm.fused_add_rms_norm, sglang.fused_add_rmsnorm):
        xi, ri = x.clone(), r.clone()
        fn(xi, ri, w, 1e-5)
        s = (x.float() + r.float()).to(dtype)
        close(ri, s)
        close(xi, rms(s, w, 1e-5), scale=4.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_activations(dtype):
    x = torch.randn(3, 2 * 48).to(dtype)
    g, u = x.float().chunk(2, -1)
    cases = {
        "silu": (F.silu(g) * u).to(dtype),
        "gelu": (F.gelu(g) * u).to(dtype),
        "gelu_tanh": (F.gelu(g, approximate="tanh") * u).to(dtype),
    }
    for name, expected in cases.items():
        out = torch.empty_like(expected)
        getattr(vllm, f"{name}_and_mul")(out, x)
        close(out, expected)
        close(getattr(sglang, f"{name}_and_mul")(x), expected)
        out2 = torch.empty_like(expected)
        assert getattr(sglang, f"{name}_and_mul")(x, out=out2) is out2
        close(out2, expected)


def test_rotary_neox_in_place():
    t, hq, hkv, d = 4, 2, 1, 16
    pos = torch.tensor([0, 3, 7, 1])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(8).float()[:, None] * inv[None]
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)  # [max_pos, d]: cos half, sin half
    q, k = torch.randn(t, hq * d), torch.randn(t, hkv * d)

    def ref(x, h):
        x = x.view(t, h, d)
        cos, sin = cache[pos, : d // 2][:, None], cache[pos, d // 2 :][:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).view(t, h * d)

    for fn in (vllm.rotary_embedding, sglang.apply_rope_with_cos_sin_cache_inplace):
        qi, ki = q.clone(), k.clone()
        fn(pos, qi, ki, d, cache, True)
        close(qi, ref(q, hq))
        close(ki, ref(k, hkv))


def vllm_paged_caches(num_blocks, hkv, d, block_size, dtype):
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    kc = torch.zeros(num_blocks, hkv, d // x, block_size, x, dtype=dtype)
    vc = torch.zeros(num_blocks, hkv, d, block_size, dtype=dtype)
    return kc, vc


def test_reshape_and_cache_vllm_layout():
    t, hkv, d, bs = 5, 2, 32, 4
    kc, vc = vllm_paged_caches(6, hkv, d, bs, torch.float32)
    key, value = torch.randn(t, hkv, d), torch.randn(t, hkv, d)
    slots = torch.tensor([0, 5, -1, 22, 13])
    vllm.reshape_and_cache(key, value, kc, vc, slots, "auto", 1.0, 1.0)
    x = kc.shape[-1]
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, bs)
        for dd in range(0, d, 7):
            assert kc[b, :, dd // x, o, dd % x].equal(key[i, :, dd])
            assert vc[b, :, dd, o].equal(value[i, :, dd])
    # nothing else touched: exactly the written (block, offset) slots are non-zero
    touched = (kc != 0).permute(0, 3, 1, 2, 4).flatten(2).any(-1).flatten().nonzero().flatten()
    assert sorted(touched.tolist()) == sorted(s for s in slots.tolist() if s >= 0)
    with pytest.raises(NotImplementedError):
        vllm.reshape_and_cache(key, value, kc, vc, slots, "fp8", 1.0, 1.0)


def paged_reference(q, kc, vc, tables, seq_lens, scale):
    """Per sequence: gather tokens 0..L-1 through the block table (vLLM's layout)."""
    bs, hq, hkv = kc.shape[3], q.shape[1], kc.shape[1]
    out = torch.empty_like(q)
    for s, length in enumerate(seq_lens.tolist()):
        toks = torch.arange(length)
        blocks = tables[s, toks // bs].long()
        k = kc[blocks, :, :, toks % bs, :].flatten(-2).float()  # [L, Hkv, D]
        v = vc[blocks, :, :, toks % bs].float()  # [L, Hkv, D]
        k = k.repeat_interleave(hq // hkv, 1)
        v = v.repeat_interleave(hq // hkv, 1)
        p = torch.einsum("hd,lhd->hl", q[s].float(), k).mul(scale).softmax(-1)
        out[s] = torch.einsum("hl,lhd->hd", p, v).to(q.dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("version", [1, 2])
def test_paged_attention_vllm_layout(dtype, version):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, bs, nb = 4, 2, 32, 8, 10
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    kc = torch.randn(nb, hkv, d // x, bs, x, generator=g).to(dtype)
    vc = torch.randn(nb, hkv, d, bs, generator=g).to(dtype)
    seq_lens = torch.tensor([13, 1, 24], dtype=torch.int32)
    tables = torch.tensor([[7, 2, 0], [4, 0, 0], [1, 9, 3]], dtype=torch.int32)
    q = torch.randn(3, hq, d, generator=g).to(dtype)
    scale = 1 / math.sqrt(d)
    out = torch.empty_like(q)
    args = (q, kc, vc, hkv, scale, tables, seq_lens, bs, 24, None, "auto", 1.0, 1.0)
    if version == 1:
        vllm.paged_attention_v1(out, *args)
    else:
        scratch = torch.empty(1)
        vllm.paged_attention_v2(out, scratch, scratch, scratch, *args)
    close(out, paged_reference(q, kc, vc, tables, seq_lens, scale), scale=4.0)


def test_topk_softmax_and_fused_topk():
    logits = torch.randn(6, 8)
    w, ids = torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32)
    rows = torch.empty(6, 2, dtype=torch.int32)
    vllm.topk_softmax(w, ids, rows, logits)
    ref_w, ref_ids = logits.softmax(-1).topk(2, -1)
    close(w, ref_w)
    assert ids.equal(ref_ids.int())
    assert rows.equal(torch.arange(12, dtype=torch.int32).view(2, 6).t())
    w2, ids2 = torch.empty(6, 2), torch.empty(6, 2, dtype=torch.int32)
    sglang.topk_softmax(w2, ids2, logits, renormalize=True)
    close(w2, ref_w / ref_w.sum(-1, keepdim=True))
    fw, fids, _ = vllm.fused_topk(torch.empty(6, 4), logits, 2, False)
    close(fw, ref_w)
    assert fids.equal(ids)


def moe_reference(x, w1, w2, tw, tid):
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(tid.shape[1]):
            e = int(tid[t, j])
            h = w1[e].float() @ x[t].float()
            a = F.silu(h[:inter]) * h[inter:]  # vLLM's w13: gate rows first, then up
            out[t] += tw[t, j].float() * (w2[e].float() @ a)
    return out.to(x.dtype)


@pytest.mark.parametrize("inplace", [False, True])
def test_fused_experts_and_fused_moe(inplace):
    g = torch.Generator().manual_seed(0)
    t, h, inter, e, k = 5, 32, 24, 4, 2
    x = torch.randn(t, h, generator=g)
    w1 = torch.randn(e, 2 * inter, h, generator=g) / 8
    w2 = torch.randn(e, h, inter, generator=g) / 8
    logits = torch.randn(t, e, generator=g)
    tw, tid = logits.softmax(-1).topk(k, -1)
    expected = moe_reference(x, w1, w2, tw, tid)
    xi = x.clone()
    out = vllm.fused_experts(xi, w1, w2, tw, tid.int(), inplace=inplace)
    close(out, expected, scale=4.0)
    assert (out is xi) == inplace
    renorm = tw / tw.sum(-1, keepdim=True)
    close(vllm.fused_moe(x, w1, w2, logits, k, True), moe_reference(x, w1, w2, renorm, tid), 4.0)
    with pytest.raises(NotImplementedError):
        vllm.fused_experts(x, w1, w2, tw, tid, use_fp8_w8a8=True)


# --- vLLM 0.33.0 signatures (tests/vllm_lane/test_vllm_compat.py checks them against vLLM) --


def test_vllm_topk_softmax_bias_and_padding():
    g = torch.Generator().manual_seed(1)
    logits, bias = torch.randn(6, 8, generator=g), torch.randn(8, generator=g)
    w, ids = torch.empty(6, 3), torch.empty(6, 3, dtype=torch.int32)
    rows = torch.empty(6, 3, dtype=torch.int32)
    padding = torch.tensor([False, False, True, False, False, True])
    vllm.topk_softmax(w, ids, rows, logits, True, bias, padding)
    scores = logits.softmax(-1)
    chosen = (scores + bias).topk(3, -1).indices  # bias picks the experts ...
    picked = scores.gather(1, chosen)  # ... the weights stay the softmax scores
    close(w, picked / picked.sum(-1, keepdim=True))
    assert ids[~padding].equal(chosen[~padding].int())
    assert (ids[padding] == -1).all()  # padding rows are routed to no expert


def test_vllm_fused_experts_current_signature():
    class MoEActivation(enum.Enum):  # the shape of vLLM's enum: .value is the name
        SILU = "silu"

    g = torch.Generator().manual_seed(2)
    t, h, inter, e, k = 5, 32, 24, 4, 2
    x = torch.randn(t, h, generator=g)
    w1 = torch.randn(e, 2 * inter, h, generator=g) / 8
    w2 = torch.randn(e, h, inter, generator=g) / 8
    tw, tid = torch.randn(t, e, generator=g).softmax(-1).topk(k, -1)
    tid = tid.int()
    expected = moe_reference(x, w1, w2, tw, tid)
    # activation is the sixth positional argument (vLLM >= 0.24), as a str or an enum
    close(vllm.fused_experts(x, w1, w2, tw, tid, "silu"), expected, scale=4.0)
    close(vllm.fused_experts(x, w1, w2, tw, tid, MoEActivation.SILU), expected, scale=4.0)
    with pytest.raises(TypeError, match="argument 6 is 'activation'.*pass inplace=... by keyword"):
        vllm.fused_experts(x, w1, w2, tw, tid, True)  # vLLM <= 0.23's positional inplace
    # a negative id (a padding row's slot) contributes nothing
    padded = tid.clone()
    padded[1, 0] = -1
    keep = tw.clone()
    keep[1, 0] = 0
    close(vllm.fused_experts(x, w1, w2, tw, padded), moe_reference(x, w1, w2, keep, tid), 4.0)


def test_vllm_norm_without_weight_and_inverse_rotary():
    x = torch.randn(4, 32)
    out = torch.empty_like(x)
    vllm.rms_norm(out, x, None, 1e-6)
    close(out, rms(x, torch.ones(32), 1e-6))
    d, pos = 16, torch.tensor([0, 5, 2])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(8).float()[:, None] * inv[None]
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    q = torch.randn(3, 2 * d)
    qi = q.clone()
    vllm.rotary_embedding(pos, qi, None, d, cache, True)
    vllm.rotary_embedding(pos, qi, None, d, cache, True, 0, True)  # inverse: undoes it
    close(qi, q)
    with pytest.raises(NotImplementedError, match="rope_dim_offset=4"):
        vllm.rotary_embedding(pos, qi, None, d, cache, True, 4)
    kc, vc = vllm_paged_caches(2, 1, 16, 4, torch.float32)
    with pytest.raises(NotImplementedError, match="interleaved_v=True"):
        vllm.reshape_and_cache(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), kc, vc,
                               torch.tensor([0]), "auto", 1.0, 1.0, True)  # fmt: skip
