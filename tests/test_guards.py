"""The memory-safety guards of the native CPU kernels, each with a case that reaches it.

Every case calls the CPU kernel itself (``redispatch`` to the CPU key), so what is tested
is the C++ check (csrc/common/op_checks.h or the binding), not the Python check of the
reference fallback in front of it: delete a guard and its case here fails (each was
checked that way; the list is in docs/ops.md, "Guards"). Device cases put one argument
on the meta device, the only second device a CPU-only machine has.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

from torch_topg import reference

OPS = ("rotary_embedding", "reshape_and_cache", "paged_attention", "attention", "rms_norm")
OPS += ("fused_add_rms_norm", "fused_moe", "moe_topk", "linear", "silu_and_mul")

pytestmark = pytest.mark.skipif(
    not all(torch._C._dispatch_has_kernel_for_dispatch_key(f"topg::{op}", "CPU") for op in OPS),
    reason="needs the native CPU kernels (not built, or TOPG_DISABLE_NATIVE=1)",
)

CPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def cpu(op: str, *args: Any, **kwargs: Any) -> Any:
    """Call the CPU kernel of ``topg::<op>`` directly (no fallback, no Python check)."""
    return getattr(torch.ops.topg, op).default.redispatch(CPU_KEYS, *args, **kwargs)


def strided_last(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor of ``shape`` whose last dimension has stride 2."""
    return torch.randn(*shape[:-1], shape[-1] * 2, dtype=dtype)[..., ::2]


# ------------------------------------------------------------------------- rotary
def _rotary(T: int = 3, heads: int = 2, head: int = 8, rot: int = 8, max_pos: int = 16):
    pos = torch.arange(T)
    q = torch.randn(T, heads * head)
    k = torch.randn(T, heads * head)
    cache = torch.randn(max_pos, rot)
    return pos, q, k, head, cache


def test_rotary_rot_dim_above_head_size() -> None:
    pos, q, k, head, _ = _rotary()
    cache = torch.randn(16, head + 2)  # would write past each head
    with pytest.raises(RuntimeError, match=r"'cos_sin_cache'.*in \[2, head_size=8\]"):
        cpu("rotary_embedding", pos, q, k, head, cache, True)


@pytest.mark.parametrize("bad", [-1, 16])
def test_rotary_positions_outside_the_cache(bad: int) -> None:
    pos, q, k, head, cache = _rotary()
    pos[1] = bad  # a read before / after the cache
    with pytest.raises(RuntimeError, match=r"'positions'.*values in \[0, 16\)"):
        cpu("rotary_embedding", pos, q, k, head, cache, True)


@pytest.mark.parametrize("name", ["query", "key"])
def test_rotary_last_dim_stride(name: str) -> None:
    pos, q, k, head, cache = _rotary()
    args = {"query": q, "key": k}
    args[name] = strided_last(tuple(args[name].shape))
    with pytest.raises(RuntimeError, match=rf"'{name}'.*stride 1 in the last dimension"):
        cpu("rotary_embedding", pos, args["query"], args["key"], head, cache, True)


# ------------------------------------------------------------------------- KV cache
def _cache(T: int = 3, hkv: int = 2, d: int = 8, blocks: int = 4, bs: int = 4):
    key, value = torch.randn(T, hkv, d), torch.randn(T, hkv, d)
    kc, vc = torch.zeros(blocks, bs, hkv, d), torch.zeros(blocks, bs, hkv, d)
    return key, value, kc, vc, torch.arange(T)


@pytest.mark.parametrize("name", ["key_cache", "value_cache"])
@pytest.mark.parametrize("layout", ["expanded", "strided"])
def test_cache_write_needs_a_contiguous_cache(name: str, layout: str) -> None:
    key, value, kc, vc, slots = _cache()
    args = {"key_cache": kc, "value_cache": vc}
    if layout == "expanded":  # every block aliases one: writes would land on each other
        args[name] = torch.zeros(1, 4, 2, 8).expand(4, 4, 2, 8)
    else:
        args[name] = torch.zeros(4, 8, 2, 8)[:, ::2]
    with pytest.raises(RuntimeError, match=rf"'{name}'.*a contiguous tensor"):
        cpu("reshape_and_cache", key, value, args["key_cache"], args["value_cache"], slots)


@pytest.mark.parametrize("name", ["key", "value"])
def test_cache_write_last_dim_stride(name: str) -> None:
    key, value, kc, vc, slots = _cache()
    args = {"key": key, "value": value}
    args[name] = strided_last((3, 2, 8))
    with pytest.raises(RuntimeError, match=rf"'{name}'.*stride 1 in the last dimension"):
        cpu("reshape_and_cache", args["key"], args["value"], kc, vc, slots)


def test_cache_write_slot_out_of_range() -> None:
    key, value, kc, vc, slots = _cache()
    slots[2] = 16  # 4 blocks x 4 slots
    with pytest.raises(RuntimeError, match=r"'slot_mapping'.*slots below 16.*for token 2"):
        cpu("reshape_and_cache", key, value, kc, vc, slots)
    assert not kc.any() and not vc.any()  # nothing written before the check


# ------------------------------------------------------------------------- paged attention
def _paged(block_size: int = 4):
    q = torch.randn(2, 4, 8)
    kc, vc = torch.randn(4, block_size, 2, 8), torch.randn(4, block_size, 2, 8)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    sl = torch.tensor([5, 3], dtype=torch.int32)
    return q, kc, vc, bt, sl


@pytest.mark.parametrize("name", ["key_cache", "value_cache"])
@pytest.mark.parametrize("layout", ["expanded", "strided"])
def test_paged_attention_needs_a_contiguous_cache(name: str, layout: str) -> None:
    q, kc, vc, bt, sl = _paged()
    args = {"key_cache": kc, "value_cache": vc}
    if layout == "expanded":
        args[name] = torch.randn(1, 4, 2, 8).expand(4, 4, 2, 8)
    else:
        args[name] = torch.randn(4, 8, 2, 8)[:, ::2]
    with pytest.raises(RuntimeError, match=rf"'{name}'.*a contiguous tensor"):
        cpu("paged_attention", q, args["key_cache"], args["value_cache"], bt, sl)


def test_paged_attention_query_last_dim_stride() -> None:
    _, kc, vc, bt, sl = _paged()
    with pytest.raises(RuntimeError, match=r"'query'.*stride 1 in the last dimension"):
        cpu("paged_attention", strided_last((2, 4, 8)), kc, vc, bt, sl)


def test_paged_attention_block_size_zero_is_an_error_not_sigfpe() -> None:
    # In a child: before the guard this was a division by zero (SIGFPE) in the kernel.
    code = textwrap.dedent(
        """
        import torch, torch_topg
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
        q = torch.randn(1, 2, 8)
        kc = torch.randn(4, 0, 2, 8)
        bt = torch.zeros(1, 1, dtype=torch.int32)
        sl = torch.ones(1, dtype=torch.int32)
        try:
            torch.ops.topg.paged_attention.default.redispatch(keys, q, kc, kc, bt, sl)
        except RuntimeError as e:
            print("ERROR", e)
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"child ended with {r.returncode}: {r.stderr[-2000:]}"
    assert "'key_cache'" in r.stdout and "a block size (size at dim 1)" in r.stdout, r.stdout


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("seq_lens", 9, r"'seq_lens'.*values in \[0, 8\]"),
        ("seq_lens", -1, r"'seq_lens'.*values in \[0, 8\]"),
        ("block_tables", 4, r"'block_tables'.*block ids in \[0, 4\)"),
        ("block_tables", -1, r"'block_tables'.*block ids in \[0, 4\)"),
    ],
)
def test_paged_attention_index_values(field: str, value: int, match: str) -> None:
    q, kc, vc, bt, sl = _paged()
    if field == "seq_lens":
        sl[0] = value
    else:
        bt[0, 1] = value  # a block the first sequence (5 tokens) uses
    with pytest.raises(RuntimeError, match=match):
        cpu("paged_attention", q, kc, vc, bt, sl)


# ------------------------------------------------------------------------- attention
@pytest.mark.parametrize("name", ["query", "key", "value"])
def test_attention_last_dim_stride(name: str) -> None:
    args = {n: torch.randn(1, 5, 2, 8) for n in ("query", "key", "value")}
    args[name] = strided_last((1, 5, 2, 8))
    with pytest.raises(RuntimeError, match=rf"'{name}'.*stride 1 in the last dimension"):
        cpu("attention", args["query"], args["key"], args["value"])


def test_attention_ragged_offsets_out_of_range() -> None:
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)  # ends past the 6 tokens
    with pytest.raises(RuntimeError, match=r"'cu_seqlens_q'.*non-decreasing offsets from 0 to 6"):
        cpu("attention", q, q, q, cu_seqlens_q=cu)


# ------------------------------------------------------------------------- norms
def test_rms_norm_weight_contiguous() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(RuntimeError, match=r"'weight'.*a contiguous tensor"):
        cpu("rms_norm", x, torch.randn(16)[::2], 1e-6)


@pytest.mark.parametrize("name", ["input", "residual", "weight"])
def test_fused_add_rms_norm_contiguous(name: str) -> None:
    args = {"input": torch.randn(3, 8), "residual": torch.randn(3, 8), "weight": torch.randn(8)}
    args[name] = torch.randn(*args[name].shape[:-1], 16)[..., ::2]
    with pytest.raises(RuntimeError, match=rf"'{name}'.*a contiguous tensor"):
        cpu("fused_add_rms_norm", args["input"], args["residual"], args["weight"], 1e-6)


# ------------------------------------------------------------------------- mixture of experts
def _moe(tokens: int = 3, E: int = 4, H: int = 8, inter: int = 6, k: int = 2):
    x = torch.randn(tokens, H)
    w13, w2 = torch.randn(E, 2 * inter, H), torch.randn(E, H, inter)
    tw = torch.rand(tokens, k)
    ids = torch.randint(0, E, (tokens, k), dtype=torch.int32)
    return x, w13, w2, tw, ids


@pytest.mark.parametrize("name", ["w_gate_up", "w_down"])
def test_fused_moe_weights_contiguous(name: str) -> None:
    x, w13, w2, tw, ids = _moe()
    args = {"w_gate_up": w13, "w_down": w2}
    args[name] = args[name].transpose(1, 2).contiguous().transpose(1, 2)
    with pytest.raises(RuntimeError, match=rf"'{name}'.*a contiguous tensor"):
        cpu("fused_moe", x, args["w_gate_up"], args["w_down"], tw, ids)


@pytest.mark.parametrize("name", ["topk_weights", "topk_ids"])
def test_fused_moe_routing_device(name: str) -> None:
    x, w13, w2, tw, ids = _moe()
    args = {"topk_weights": tw, "topk_ids": ids}
    args[name] = args[name].to("meta")
    with pytest.raises(
        RuntimeError, match=rf"'{name}'.*device cpu \(the device of 'hidden_states'\)"
    ):
        cpu("fused_moe", x, w13, w2, args["topk_weights"], args["topk_ids"])


@pytest.mark.parametrize("bad", [-1, 4])
def test_fused_moe_expert_ids(bad: int) -> None:
    x, w13, w2, tw, ids = _moe()
    ids[1, 1] = bad
    with pytest.raises(RuntimeError, match=rf"expert id {bad} at flat index 3"):
        cpu("fused_moe", x, w13, w2, tw, ids)


def test_moe_topk_correction_bias_device() -> None:
    logits = torch.randn(3, 8)
    with pytest.raises(
        RuntimeError, match=r"'correction_bias'.*device cpu \(the device of 'router_logits'\)"
    ):
        cpu("moe_topk", logits, 2, correction_bias=torch.zeros(8, device="meta"))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("where", [0, 3, 7])
def test_moe_topk_nan_logit_matches_reference(scoring: str, renormalize: bool, where: int) -> None:
    """A NaN logit ranks above every number (torch.sort's order): the remaining experts
    are still considered, and the weights say NaN where the reference does."""
    g = torch.Generator().manual_seed(where)
    logits = torch.randn(4, 8, generator=g)
    logits[1, where] = float("nan")
    logits[2, (where + 2) % 8] = float("inf")
    bias = torch.randn(8, generator=g)
    for b in (None, bias):
        kw = {"scoring": scoring, "renormalize": renormalize, "correction_bias": b}
        w, ids = cpu("moe_topk", logits, 3, **kw)
        rw, rids = reference.moe_topk(logits, 3, **kw)
        torch.testing.assert_close(ids, rids, rtol=0, atol=0)
        torch.testing.assert_close(w, rw, equal_nan=True)


# ------------------------------------------------------------------------- dense ops
def test_linear_weight_contiguous() -> None:
    with pytest.raises(RuntimeError, match=r"'weight'.*a contiguous tensor"):
        cpu("linear", torch.randn(2, 8), torch.randn(8, 6).t())


def test_linear_bias_device() -> None:
    with pytest.raises(RuntimeError, match=r"'bias'.*device cpu \(the device of 'input'\)"):
        cpu("linear", torch.randn(2, 8), torch.randn(6, 8), torch.zeros(6, device="meta"))


# ------------------------------------------------------------------------- CUDA index checks
def test_index_checks_mode_toggles_and_restores() -> None:
    import torch_topg

    before = torch_topg.set_index_checks(False)
    try:
        assert torch_topg.set_index_checks(False) is False
        with torch_topg.index_checks():
            assert torch.ops.topg._set_index_checks.default(True) is True  # on inside
        assert torch_topg.set_index_checks(False) is False  # restored on exit
    finally:
        torch_topg.set_index_checks(before)
