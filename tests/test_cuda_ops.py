"""CUDA kernels against their references (on the same GPU): norms, rotary, activations,
reshape_and_cache, moe_topk, fused_moe, linear; bad indices; a compiled block.

The cases every op shares with the CPU (samples against the reference, opcheck, a
fullgraph compile, bad inputs, NaN / inf / empty inputs) run from tests/op_samples.py in
tests/test_ops_common.py for both devices; this file keeps what is CUDA-specific: the
hypothesis sweeps and the sizes that pick each kernel path.

Every test skips without a CUDA device, and each kernel test also skips (naming why) when
the extension has no CUDA kernel registered. The attention kernels are in
test_cuda_attention.py. Sizes are awkward on purpose: odd token counts, hidden sizes that
are not multiples of 8 (the scalar paths), 1-element dimensions, tiles with tails.
"""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, NEEDS_CUDA, assert_close, requires_cuda_kernel
from hypothesis import example, given
from hypothesis import strategies as st
from op_samples import Gen, cos_sin

import torch_topg
from torch_topg import reference

pytestmark = NEEDS_CUDA
DEV = "cuda"


_G = Gen(DEV)  # seeded; drawn on the CPU and moved, as in op_samples
_rand = _G.randn


# --- norms ---------------------------------------------------------------------------------
NORM_SHAPES = st.tuples(st.integers(1, 5), st.integers(1, 3), st.integers(1, 300))


@requires_cuda_kernel("rms_norm")
@given(shape=NORM_SHAPES, dtype=st.sampled_from(DTYPES), f32_weight=st.booleans())
@example(shape=(1, 1, 4096), dtype=torch.bfloat16, f32_weight=False)  # vector path
@example(shape=(5, 3, 123), dtype=torch.float16, f32_weight=True)  # scalar path
@example(shape=(2, 1, 16384), dtype=torch.float32, f32_weight=False)  # 1024 threads, 2 loops
@example(shape=(1, 1, 1), dtype=torch.float32, f32_weight=False)
def test_cuda_rms_norm(shape, dtype, f32_weight):
    x = _rand(*shape, dtype=dtype, scale=3)
    w = _rand(shape[-1], dtype=torch.float32 if f32_weight else dtype)
    assert_close(torch_topg.ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


@requires_cuda_kernel("rms_norm")
def test_cuda_rms_norm_non_contiguous_and_unaligned():
    x = _rand(64, 8, 96).transpose(0, 1)
    w = _rand(96)
    assert_close(torch_topg.ops.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
    flat = _rand(3 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 64)  # 2-byte offset: scalar path
    wb = _rand(64, dtype=torch.bfloat16)
    assert_close(torch_topg.ops.rms_norm(flat, wb, 1e-6), reference.rms_norm(flat, wb, 1e-6))


@requires_cuda_kernel("fused_add_rms_norm")
@given(shape=NORM_SHAPES, dtype=st.sampled_from(DTYPES))
@example(shape=(1, 1, 576), dtype=torch.bfloat16)
@example(shape=(4, 3, 17), dtype=torch.float16)
def test_cuda_fused_add_rms_norm(shape, dtype):
    x, r = _rand(*shape, dtype=dtype), _rand(*shape, dtype=dtype)
    w = _rand(shape[-1], dtype=dtype)
    x_ref, r_ref = x.clone(), r.clone()
    torch_topg.ops.fused_add_rms_norm(x, r, w, 1e-6)
    reference.fused_add_rms_norm(x_ref, r_ref, w, 1e-6)
    torch.testing.assert_close(r, r_ref, atol=0, rtol=0)  # the add is exact per element
    assert_close(x, x_ref)


# --- rotary --------------------------------------------------------------------------------
def _cos_sin(max_pos: int, rot_dim: int, dtype: torch.dtype) -> torch.Tensor:
    return cos_sin(_G, max_pos, rot_dim, dtype)


@requires_cuda_kernel("rotary_embedding")
@given(
    tokens=st.integers(1, 40),
    hq=st.integers(1, 6),
    hk=st.integers(0, 3),
    head_size=st.sampled_from([2, 6, 16, 20, 64, 80, 128]),
    rot_frac=st.sampled_from([1.0, 0.5, 0.25]),
    is_neox=st.booleans(),
    dtype=st.sampled_from(DTYPES),
    f32_cache=st.booleans(),
    pos32=st.booleans(),
)
@example(1, 9, 3, 64, 1.0, True, torch.bfloat16, False, False)  # vector path, neox
@example(7, 2, 1, 128, 1.0, False, torch.float32, True, True)  # vector path, gpt-j
@example(5, 3, 1, 20, 1.0, True, torch.float16, False, True)  # scalar path
def test_cuda_rotary_embedding(
    tokens, hq, hk, head_size, rot_frac, is_neox, dtype, f32_cache, pos32
):
    rot_dim = max(2, int(head_size * rot_frac) // 2 * 2)
    cache = _cos_sin(97, rot_dim, torch.float32 if f32_cache else dtype)
    positions = torch.randint(0, 97, (tokens,), device=DEV)
    positions = positions.int() if pos32 else positions
    q, k = _rand(tokens, hq * head_size, dtype=dtype), _rand(tokens, hk * head_size, dtype=dtype)
    q_ref, k_ref = q.clone(), k.clone()
    torch_topg.ops.rotary_embedding(positions, q, k if hk else None, head_size, cache, is_neox)
    reference.rotary_embedding(positions, q_ref, k_ref if hk else None, head_size, cache, is_neox)
    assert_close(q, q_ref)
    assert_close(k, k_ref)


@requires_cuda_kernel("rotary_embedding")
def test_cuda_rotary_fused_qkv_slice():
    b, s, hq, hk, d = 2, 5, 4, 2, 64
    qkv = _rand(b, s, (hq + 2 * hk) * d)
    q, k = qkv[..., : hq * d], qkv[..., hq * d : (hq + hk) * d]  # strided views, in place
    positions = torch.arange(s, device=DEV).expand(b, s).contiguous()
    cache = _cos_sin(16, d, torch.float32)
    q_ref, k_ref = q.clone(), k.clone()
    torch_topg.ops.rotary_embedding(positions, q, k, d, cache, True)
    reference.rotary_embedding(positions, q_ref, k_ref, d, cache, True)
    assert_close(q, q_ref)
    assert_close(k, k_ref)


# --- activations ---------------------------------------------------------------------------
@requires_cuda_kernel("silu_and_mul")
@given(
    shape=st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 200)),
    dtype=st.sampled_from(DTYPES),
    act=st.sampled_from(["silu", "none", "tanh"]),
)
@example(shape=(1, 1, 1536), dtype=torch.bfloat16, act="silu")
@example(shape=(3, 2, 13), dtype=torch.float16, act="tanh")
@example(shape=(1, 1, 70000), dtype=torch.float32, act="none")  # > one block of columns
def test_cuda_gated_activations(shape, dtype, act):
    x = _rand(*shape[:-1], 2 * shape[-1], dtype=dtype, scale=4)
    if act == "silu":
        assert_close(torch_topg.ops.silu_and_mul(x), reference.silu_and_mul(x))
    else:
        got = torch_topg.ops.gelu_and_mul(x, approximate=act)
        assert_close(got, reference.gelu_and_mul(x, approximate=act))


@requires_cuda_kernel("silu_and_mul")
def test_cuda_silu_and_mul_row_slice():
    buf = _rand(9, 3 * 48, dtype=torch.bfloat16)
    x = buf[:, 8 : 8 + 2 * 40]  # unit column stride, row stride 144: used without a copy
    assert_close(torch_topg.ops.silu_and_mul(x), reference.silu_and_mul(x))


# --- reshape_and_cache -------------------------------------------------------------------
@requires_cuda_kernel("reshape_and_cache")
@given(
    tokens=st.integers(1, 40),
    heads_dim=st.sampled_from([(1, 32), (2, 64), (8, 128), (3, 20), (2, 7)]),
    block_size=st.sampled_from([1, 16, 32]),
    dtype=st.sampled_from(DTYPES),
    index_dtype=st.sampled_from([torch.int64, torch.int32]),
    pad=st.booleans(),
    transposed=st.booleans(),
)
@example(17, (8, 128), 16, torch.bfloat16, torch.int64, True, True)
def test_cuda_reshape_and_cache(tokens, heads_dim, block_size, dtype, index_dtype, pad, transposed):
    hkv, d = heads_dim
    num_blocks = -(-tokens // block_size) + 2
    if transposed:  # [Hkv, T, D] storage seen as [T, Hkv, D]
        key = _rand(hkv, tokens, d, dtype=dtype).transpose(0, 1)
        value = _rand(hkv, tokens, d, dtype=dtype).transpose(0, 1)
    else:
        key, value = _rand(tokens, hkv, d, dtype=dtype), _rand(tokens, hkv, d, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size, device=DEV)[:tokens]
    if pad:
        slots[::3] = -1
    slots = slots.to(index_dtype)
    kc, vc = (
        _rand(num_blocks, block_size, hkv, d, dtype=dtype),
        _rand(num_blocks, block_size, hkv, d, dtype=dtype),
    )
    kc_ref, vc_ref = kc.clone(), vc.clone()
    torch_topg.ops.reshape_and_cache(key, value, kc, vc, slots)
    reference.reshape_and_cache(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


# --- moe_topk ------------------------------------------------------------------------------
@requires_cuda_kernel("moe_topk")
@given(
    tokens=st.integers(1, 70),
    experts=st.sampled_from([1, 3, 8, 33, 64, 160, 256]),
    k=st.integers(1, 8),
    scoring=st.sampled_from(["softmax", "sigmoid"]),
    renormalize=st.booleans(),
    use_bias=st.booleans(),
    dtype=st.sampled_from(DTYPES),
)
@example(7, 8, 2, "softmax", True, False, torch.float32)  # Mixtral
@example(3, 256, 8, "sigmoid", True, True, torch.bfloat16)  # DeepSeek-V3 style
def test_cuda_moe_topk(tokens, experts, k, scoring, renormalize, use_bias, dtype):
    k = min(k, experts)
    base = torch.linspace(-4, 4, experts, device=DEV)  # distinct values: no ties
    logits = base[torch.rand(tokens, experts, device=DEV).argsort(dim=-1)].to(dtype)
    bias = torch.linspace(0.3, -0.3, experts, device=DEV) if use_bias else None
    kw = dict(scoring=scoring, renormalize=renormalize, correction_bias=bias)
    w, ids = torch_topg.ops.moe_topk(logits, k, **kw)
    w_ref, ids_ref = reference.moe_topk(logits, k, **kw)
    assert ids.dtype == torch.int32 and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=1e-5, rtol=1e-5)


# --- fused_moe -----------------------------------------------------------------------------
@requires_cuda_kernel("fused_moe")
@given(
    t=st.sampled_from([1, 3, 64, 65, 300]),
    e=st.sampled_from([1, 3, 8]),
    k=st.sampled_from([1, 2, 3]),
    h=st.sampled_from([24, 100, 256]) | st.integers(1, 64),
    i=st.sampled_from([24, 40, 100]) | st.integers(1, 64),
    dtype=st.sampled_from(DTYPES),
    act=st.sampled_from(["silu", "gelu", "gelu_tanh"]),
    ids32=st.booleans(),
    f32_weights=st.booleans(),
)
@example(1, 8, 2, 256, 64, torch.bfloat16, "silu", True, True)  # vector + tensor-core path
@example(65, 3, 3, 100, 40, torch.float16, "gelu", False, False)  # scalar path, 2 M tiles
@example(64, 1, 1, 300, 260, torch.float32, "gelu_tanh", False, True)
def test_cuda_fused_moe(t, e, k, h, i, dtype, act, ids32, f32_weights):
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(t, h, device=DEV, generator=g).to(dtype)
    wgu = (torch.randn(e, 2 * i, h, device=DEV, generator=g) / h**0.5).to(dtype)
    wd = (torch.randn(e, h, i, device=DEV, generator=g) / i**0.5).to(dtype)
    ids = torch.randint(0, e, (t, k), device=DEV, generator=g)
    ids = ids.int() if ids32 else ids
    w = torch.rand(t, k, device=DEV, generator=g)
    w = w if f32_weights else w.to(dtype)
    got = torch_topg.ops.fused_moe(x, wgu, wd, w, ids, activation=act)
    expected = reference.fused_moe(x, wgu, wd, w, ids, activation=act)
    # The intermediate act(gate) * up is stored in the input dtype (one extra rounding).
    assert_close(got, expected, scale=max(2.0, (h + i) ** 0.5 / 8))


# --- linear --------------------------------------------------------------------------------
@requires_cuda_kernel("linear")
@given(
    m=st.sampled_from([1, 2, 4, 5, 17, 64, 65, 130]),
    k=st.sampled_from([1, 7, 8, 100, 256, 1000]),
    n=st.sampled_from([1, 7, 33, 64, 65, 200]),
    dtype=st.sampled_from(DTYPES),
    bias=st.booleans(),
)
@example(m=1, k=4096, n=257, dtype=torch.bfloat16, bias=True)  # GEMV, vector path
@example(m=65, k=1000, n=65, dtype=torch.float16, bias=False)  # tiles with tails
@example(m=130, k=7, n=33, dtype=torch.float32, bias=True)  # scalar tile loads
def test_cuda_linear(m, k, n, dtype, bias):
    x = _rand(m, k, dtype=dtype)
    w = (torch.randn(n, k, device=DEV) / k**0.5).to(dtype)
    b = _rand(n, dtype=dtype) if bias else None
    assert_close(torch_topg.ops.linear(x, w, b), reference.linear(x, w, b), scale=2)


# --- index errors, device guard --------------------------------------------
@requires_cuda_kernel("reshape_and_cache")
def test_cuda_bad_indices_raise_and_write_nothing():
    kc, vc = _rand(4, 16, 2, 32), _rand(4, 16, 2, 32)
    kc0 = kc.clone()
    key = _rand(2, 2, 32)
    with pytest.raises(RuntimeError, match="argument 'slot_mapping'"):
        torch_topg.ops.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 64], device=DEV))
    assert torch.equal(kc, kc0)
    with pytest.raises(RuntimeError, match="argument 'positions'"):
        q = _rand(2, 64)
        torch_topg.ops.rotary_embedding(
            torch.tensor([0, 16], device=DEV), q, None, 64, _cos_sin(16, 64, torch.float32), True
        )
    x, wgu, wd = _rand(2, 32), _rand(4, 64, 32), _rand(4, 32, 32)
    bad = torch.tensor([[0, 4], [1, 2]], device=DEV)
    with pytest.raises(RuntimeError, match="argument 'topk_ids'"):
        torch_topg.ops.fused_moe(x, wgu, wd, torch.rand(2, 2, device=DEV), bad)


@requires_cuda_kernel("rms_norm")
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (device guard)")
def test_cuda_second_device():
    x, w = _rand(4, 64).to("cuda:1"), _rand(64).to("cuda:1")
    out = torch_topg.ops.rms_norm(x, w, 1e-6)
    assert out.device == x.device
    assert_close(out, reference.rms_norm(x, w, 1e-6))


# --- torch.compile of a block of ops ---------------------------------------------------
@requires_cuda_kernel("rms_norm")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_cuda_compile_fullgraph(backend):
    def block(x, r, w, wgu, wd, router):
        torch_topg.ops.fused_add_rms_norm(x, r, w)
        h = torch_topg.ops.linear(x, wgu[0, :64])
        weights, ids = torch_topg.ops.moe_topk(router(x), 2)
        y = torch_topg.ops.fused_moe(x, wgu, wd, weights, ids)
        return h, y + torch_topg.ops.silu_and_mul(torch.cat([x, x], -1)), r

    x, r, w = _rand(5, 64), _rand(5, 64), _rand(64)
    wgu, wd = _rand(4, 64, 64) / 8, _rand(4, 64, 32) / 8
    router = torch.nn.Linear(64, 4).to(DEV)
    expected = block(x.clone(), r.clone(), w, wgu, wd, router)
    got = torch.compile(block, fullgraph=True, backend=backend)(
        x.clone(), r.clone(), w, wgu, wd, router
    )
    for a, b in zip(got, expected, strict=True):
        assert_close(a, b, scale=2)
