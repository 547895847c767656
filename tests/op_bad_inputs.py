"""Bad inputs and NaN / inf / empty inputs of every ``topg`` op, for any device.

``bad_inputs(op, device)``: each case breaks one thing; ``match`` is the message after
``topg::<op>: ``. Structure checks (shape, dtype, device, layout) must say exactly the
same thing on every path (tests/test_check_wording.py); value checks (positions, slots,
block ids, offsets, expert ids: read from the data by the native kernel and the reference,
invisible to the fake) only match the regex. Every memory-safety guard of the native
kernels has a case here, so removing one fails a test.

``special_inputs(op, device)``: what each op does with NaN, inf and empty inputs is
what its reference does (docs/ops.md, "NaN, inf and empty inputs").
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import signal
import subprocess
import sys
import warnings
from collections.abc import Callable

import op_bad_inputs_quant as quant_cases
import torch
from op_samples import (
    F32,
    INF,
    NAN,
    BadInput,
    Gen,
    Special,
    cos_sin,
    cu,
    group_name,
    int8_caches,
    other_device,
    paged,
)
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_topg.ops import OPS, OpSpec

CRASH_DEVICE = "without a device check the CPU kernel reads another device's memory"


def _arg(name: str, what: str) -> str:
    """``argument '<name>' (shape [..], dtype .., device ..) expected <what>``."""
    return rf"argument '{name}' \(shape \[[0-9, ]*\], dtype \w+, device [\w:]+\) expected " + (
        re.escape(what)
    )


def _value(name: str, what: str) -> str:
    """A value check: the reference's message does not describe the tensor."""
    return rf"argument '{name}'.* expected " + re.escape(what)


FLOAT = "dtype float32 or bfloat16 or float16"
INDEX = "dtype int32 or int64"
STRIDE = "stride 1 in the last dimension"
CONTIG = "a contiguous tensor"


def _strided(g: Gen, *shape: int, dtype=F32) -> torch.Tensor:
    """``shape`` with stride 2 in the last dimension."""
    return g.randn(*shape[:-1], 2 * shape[-1], dtype=dtype)[..., ::2]


def _expanded(g: Gen, *shape: int) -> torch.Tensor:
    """``shape`` whose first dimension has stride 0 (an expanded, non-contiguous tensor)."""
    return g.randn(1, *shape[1:]).expand(*shape)


# --- bad inputs --------------------------------------------------------------------------
def _bad_rms_norm(g: Gen, other: str) -> list[BadInput]:
    x, w = g.randn(3, 8), g.randn(8)
    return [
        BadInput("int input", (x.int(), w, 1e-6), match=_arg("input", FLOAT)),
        BadInput("0-d input", (x[0, 0], w, 1e-6), match=_arg("input", "at least 1 dimensions")),
        BadInput("weight size", (x, g.randn(7), 1e-6), match=_arg("weight", "size 8 at dim 0 (the hidden size of 'input')")),
        BadInput("2-d weight", (x, w[None], 1e-6), match=_arg("weight", "1 dimensions")),
        BadInput("int weight", (x, w.int(), 1e-6), match=_arg("weight", FLOAT)),
        BadInput("strided weight", (x, _strided(g, 8), 1e-6), match=_arg("weight", CONTIG)),
        BadInput("weight device", (x, w.to(other), 1e-6), match=_arg("weight", f"device {x.device} (the device of 'input')")),
    ]  # fmt: skip


def _bad_add_norm(g: Gen, other: str) -> list[BadInput]:
    x, r, w = g.randn(3, 8), g.randn(3, 8), g.randn(8)
    return [
        BadInput("strided input", (g.randn(8, 3).t(), r, w, 1e-6), match=_arg("input", CONTIG)),
        BadInput("strided residual", (x, g.randn(8, 3).t(), w, 1e-6), match=_arg("residual", CONTIG)),
        BadInput("residual shape", (x, g.randn(3, 9), w, 1e-6), match=_arg("residual", "the shape of 'input' [3, 8]")),
        BadInput("residual rank", (x, g.randn(24), w, 1e-6), match=_arg("residual", "the shape of 'input' [3, 8]")),
        BadInput("residual dtype", (x, r.bfloat16(), w, 1e-6), match=_arg("residual", "dtype float32 (the dtype of 'input')")),
        BadInput("residual device", (x, r.to(other), w, 1e-6), match=_arg("residual", f"device {x.device} (the device of 'input')")),
        BadInput("weight size", (x, r, g.randn(9), 1e-6), match=_arg("weight", "size 8 at dim 0 (the hidden size of 'input')")),
        BadInput("strided weight", (x, r, _strided(g, 8), 1e-6), match=_arg("weight", CONTIG)),
    ]  # fmt: skip


def _bad_rotary(g: Gen, other: str) -> list[BadInput]:
    pos, q, k, cache = (
        g.ints([0, 3, 9, 1], torch.int64),
        g.randn(4, 32),
        g.randn(4, 16),
        cos_sin(g, 10, 16),
    )
    dev = q.device
    return [
        BadInput("float positions", (pos.float(), q, k, 16, cache, True), match=_arg("positions", INDEX)),
        BadInput("strided query", (pos, _strided(g, 4, 32), k, 16, cache, True), match=_arg("query", STRIDE)),
        BadInput("strided key", (pos, q, _strided(g, 4, 16), 16, cache, True), match=_arg("key", STRIDE)),
        BadInput("query width", (pos, g.randn(4, 20), k, 16, cache, True), match=_arg("query", "a last dimension that is a multiple of head_size 16")),
        BadInput("query rank", (pos, g.randn(4, 2, 16, 1), k, 16, cache, True), match=_arg("query", "2 or 3 dimensions (the token dims of 'positions', then heads)")),
        BadInput("query head size", (pos, g.randn(4, 2, 8), k, 16, cache, True), match=_arg("query", "size 16 at dim -1 (head_size)")),
        BadInput("query tokens", (pos, g.randn(5, 32), k, 16, cache, True), match=_arg("query", "size 4 at dim 0 (the token dims of 'positions')")),
        BadInput("key dtype", (pos, q, k.bfloat16(), 16, cache, True), match=_arg("key", "dtype float32 (the dtype of 'query')")),
        BadInput("query device", (pos, q.to(other), None, 16, cache, True), match=_arg("query", f"device {dev} (the device of 'positions')")),
        BadInput("rot_dim > head_size", (pos, q, k, 16, cos_sin(g, 10, 20), True), match=_arg("cos_sin_cache", "an even rotary dimension (size at dim 1) in [2, head_size=16]")),
        BadInput("odd rot_dim", (pos, q, k, 16, g.randn(10, 7), True), match=_arg("cos_sin_cache", "an even rotary dimension (size at dim 1) in [2, head_size=16]")),
        BadInput("strided cache", (pos, q, k, 16, g.randn(16, 10).t(), True), match=_arg("cos_sin_cache", CONTIG)),
        BadInput("cache device", (pos, q, k, 16, cache.to(other), True), match=_arg("cos_sin_cache", f"device {dev} (the device of 'query')")),
        BadInput("token dims not viewable", (g.ints([[0, 1, 2], [3, 4, 5]], torch.int64), g.randn(3, 2, 32).transpose(0, 1), None, 16, cache, True), match=_arg("query", "token dims that can be viewed as one (it is updated in place)")),
        BadInput("head_size 0", (pos, q, k, 0, cache, True), match=re.escape("argument 'head_size' expected a positive value, got 0")),
        BadInput("negative position", (g.ints([0, -1, 2, 3], torch.int64), q, k, 16, cache, True), match=_value("positions", "values in [0, 10) (rows of 'cos_sin_cache'), got [-1, 3]"), value_check=True),
        BadInput("position past the cache", (g.ints([0, 10, 2, 3]), q, k, 16, cache, True), match=_value("positions", "values in [0, 10) (rows of 'cos_sin_cache'), got [0, 10]"), value_check=True),
    ]  # fmt: skip


def _bad_gated(op: str) -> Callable[[Gen, str], list[BadInput]]:
    def bad(g: Gen, other: str) -> list[BadInput]:
        extra = ("tanh",) if op == "gelu_and_mul" else ()
        out = [
            BadInput("odd last dim", (g.randn(3, 7), *extra), match=_arg("input", "an even last dimension (gate | up)")),
            BadInput("int input", (g.randn(3, 8).int(), *extra), match=_arg("input", FLOAT)),
            BadInput("0-d input", (g.randn(1)[0], *extra), match=_arg("input", "at least 1 dimensions")),
        ]  # fmt: skip
        if extra:
            msg = re.escape("argument 'approximate' expected 'none' or 'tanh', got 'fast'")
            out.append(BadInput("approximate", (g.randn(3, 8), "fast"), match=msg))
        return out

    return bad


def _bad_attention(g: Gen, other: str) -> list[BadInput]:
    q, k, v = g.randn(2, 5, 4, 16), g.randn(2, 7, 2, 16), g.randn(2, 7, 2, 16)
    rq, rk, rv, c = g.randn(9, 4, 16), g.randn(9, 2, 16), g.randn(9, 2, 16), cu(g, [4, 5])
    dev = q.device
    return [
        BadInput("3-d dense query", (q[0], k, v), match=_arg("query", "4 dimensions")),
        BadInput("int query", (q.int(), k, v), match=_arg("query", FLOAT)),
        BadInput("key dtype", (q, k.bfloat16(), v), match=_arg("key", "dtype float32 (the dtype of 'query')")),
        BadInput("key device", (q, k.to(other), v), match=_arg("key", f"device {dev} (the device of 'query')")),
        BadInput("key head_dim", (q, g.randn(2, 7, 2, 8), v), match=_arg("key", "size 16 at dim 3 (head_dim of 'query')")),
        BadInput("value length", (q, k, g.randn(2, 6, 2, 16)), match=_arg("value", "size 7 at dim 1 (the shape of 'key')")),
        BadInput("value head_dim", (q, k, g.randn(2, 7, 2, 8)), match=_arg("value", "size 16 at dim 3 (head_dim of 'query')")),
        BadInput("strided query", (_strided(g, 2, 5, 4, 16), k, v), match=_arg("query", STRIDE)),
        BadInput("strided key", (q, _strided(g, 2, 7, 2, 16), v), match=_arg("key", STRIDE)),
        BadInput("strided value", (q, k, _strided(g, 2, 7, 2, 16)), match=_arg("value", STRIDE)),
        BadInput("heads", (q, g.randn(2, 7, 3, 16), g.randn(2, 7, 3, 16)), match=re.escape("query heads (4) must be a multiple of key/value heads (3)")),
        BadInput("window", (q, k, v), {"window_left": -2}, match=re.escape("window_left must be >= -1, got -2")),
        BadInput("softcap", (q, k, v), {"softcap": -1.5}, match=re.escape("softcap must be >= 0, got -1.5")),
        *_bad_sinks(g, (q, k, v), 4, other),
        BadInput("key batch", (q, k[:1], v[:1]), match=_arg("key", "size 2 at dim 0 (the batch of 'query')")),
        BadInput("cu_seqlens_k dense", (q, k, v), {"cu_seqlens_k": c}, match=_arg("cu_seqlens_k", "None without 'cu_seqlens_q'")),
        BadInput("int mask", (q, k, v), {"mask": g.randint(2, 5, 7)}, match=_arg("mask", FLOAT)),
        BadInput("mask device", (q, k, v), {"mask": g.randn(5, 7).to(other)}, match=_arg("mask", f"device {dev} (the device of 'query')")),
        BadInput("mask shape", (q, k, v), {"mask": g.randn(2, 1, 5, 6)}, match=re.escape("argument 'mask' (shape [2, 1, 5, 6]) expected a shape broadcastable to [B, Hq, Sq, Sk] = [2, 4, 5, 7]")),
        BadInput("5-d mask", (q, k, v), {"mask": g.randn(1, 2, 1, 5, 7)}, match=_arg("mask", "at most 4 dimensions (broadcastable to [B, Hq, Sq, Sk])")),
        BadInput("int64 cu_seqlens_q", (rq, rk, rv), {"cu_seqlens_q": c.long()}, match=_arg("cu_seqlens_q", "dtype int32")),
        BadInput("cu_seqlens_k size", (rq, rk, rv), {"cu_seqlens_q": c, "cu_seqlens_k": cu(g, [9])}, match=_arg("cu_seqlens_k", "size 3 at dim 0 (batch + 1, the size of 'cu_seqlens_q')")),
        BadInput("ragged mask", (rq, rk, rv), {"cu_seqlens_q": c, "mask": g.randn(9, 9)}, match=_arg("mask", "None with ragged (cu_seqlens) input")),
        BadInput("ragged key tokens", (rq, g.randn(10, 2, 16), g.randn(10, 2, 16)), {"cu_seqlens_q": c}, match=_arg("key", "9 tokens (the tokens of 'query', as 'cu_seqlens_k' is None)")),
        BadInput("cu_seqlens_q values", (rq, rk, rv), {"cu_seqlens_q": g.ints([0, 5, 4])}, match=_value("cu_seqlens_q", "non-decreasing offsets from 0 to 9 (the token count)"), value_check=True),
    ]  # fmt: skip


def _bad_paged(g: Gen, other: str) -> list[BadInput]:
    q, kc, vc, bt, sl = paged(g, [5, 9], 4, 2, 16, 4)
    nb = kc.shape[0]
    dev = q.device
    return [
        BadInput("4-d query", (q[None], kc, vc, bt, sl), match=_arg("query", "3 dimensions")),
        BadInput("strided query", (_strided(g, 2, 4, 16), kc, vc, bt, sl), match=_arg("query", STRIDE)),
        BadInput("cache dtype", (q, kc.bfloat16(), vc, bt, sl), match=_arg("key_cache", "dtype float32 (the dtype of 'query') or int8 (with 'key_scale' and 'value_scale')")),
        BadInput("value_cache dtype", (q, kc, vc.half(), bt, sl), match=_arg("value_cache", "dtype float32 (the dtype of 'key_cache')")),
        *_bad_scales(g, (q, kc, vc, bt, sl), 1, other),
        BadInput("expanded key_cache", (q, _expanded(g, *kc.shape), vc, bt, sl), match=_arg("key_cache", CONTIG)),
        BadInput("strided value_cache", (q, kc, g.randn(2 * nb, 4, 2, 16)[::2], bt, sl), match=_arg("value_cache", CONTIG)),
        BadInput("cache head_dim", (q, g.randn(nb, 4, 2, 8), vc, bt, sl), match=_arg("key_cache", "size 16 at dim 3 (head_dim of 'query')")),
        BadInput("value_cache shape", (q, kc, g.randn(nb, 4, 1, 16), bt, sl), match=_arg("value_cache", "size 2 at dim 2 (the shape of 'key_cache')")),
        BadInput("block_size 0", (q, g.randn(nb, 0, 2, 16), g.randn(nb, 0, 2, 16), bt, sl), match=_arg("key_cache", "a block size (size at dim 1) of at least one token"), crashes_native="the CPU kernel divides by the block size (SIGFPE)"),
        BadInput("heads", (q, g.randn(nb, 4, 3, 16), g.randn(nb, 4, 3, 16), bt, sl), match=re.escape("query heads (4) must be a multiple of key/value heads (3)")),
        BadInput("int64 block_tables", (q, kc, vc, bt.long(), sl), match=_arg("block_tables", "dtype int32")),
        BadInput("block_tables device", (q, kc, vc, bt.to(other), sl), match=_arg("block_tables", f"device {dev} (the device of 'query')")),
        BadInput("seq_lens size", (q, kc, vc, bt, g.ints([5, 9, 1])), match=_arg("seq_lens", "size 2 at dim 0 (num_seqs of 'query')")),
        BadInput("block_tables rows", (q, kc, vc, bt[:1], sl), match=_arg("block_tables", "size 2 at dim 0 (num_seqs of 'query')")),
        BadInput("cu_seqlens_q size", (q, kc, vc, bt, sl), {"cu_seqlens_q": g.ints([0, 2])}, match=_arg("cu_seqlens_q", "size 3 at dim 0 (num_seqs + 1, from 'seq_lens')")),
        BadInput("window", (q, kc, vc, bt, sl), {"window_left": -3}, match=re.escape("window_left must be >= -1, got -3")),
        BadInput("softcap", (q, kc, vc, bt, sl), {"softcap": -1.0}, match=re.escape("softcap must be >= 0, got -1")),
        *_bad_sinks(g, (q, kc, vc, bt, sl), 4, other),
        BadInput("block id", (q, kc, vc, bt.index_fill(1, g.ints([0], torch.int64), nb), sl), match=_value("block_tables", f"block ids in [0, {nb})"), value_check=True),
        BadInput("seq_len too long", (q, kc, vc, bt, g.ints([5, 4 * bt.shape[1] + 1])), match=_value("seq_lens", f"values in [0, {4 * bt.shape[1]}] (max_blocks_per_seq * block_size)"), value_check=True),
        BadInput("cu_seqlens_q values", (g.randn(3, 4, 16), kc, vc, bt, sl), {"cu_seqlens_q": g.ints([0, 2, 1])}, match=_value("cu_seqlens_q", "non-decreasing offsets from 0 to 3 (the query rows)"), value_check=True),
        BadInput("q_len > seq_len", (g.randn(7, 4, 16), kc, vc, bt, sl), {"cu_seqlens_q": g.ints([0, 6, 7])}, match=_value("cu_seqlens_q", "at most seq_lens[0] = 5 query tokens for sequence 0 (its last tokens), got 6"), value_check=True),
    ]  # fmt: skip


def _bad_sinks(g: Gen, args: tuple, hq: int, other: str) -> list[BadInput]:
    """Attention sinks: float32 [hq] on the query's device, contiguous."""
    dev = args[0].device
    return [
        BadInput("sinks shape", args, {"sinks": g.randn(hq + 1)}, match=_arg("sinks", f"size {hq} at dim 0 (the query heads of 'query')")),
        BadInput("2-d sinks", args, {"sinks": g.randn(1, hq)}, match=_arg("sinks", "1 dimensions")),
        BadInput("sinks dtype", args, {"sinks": g.randn(hq).bfloat16()}, match=_arg("sinks", "dtype float32")),
        BadInput("sinks device", args, {"sinks": g.randn(hq).to(other)}, match=_arg("sinks", f"device {dev} (the device of 'query')")),
        BadInput("strided sinks", args, {"sinks": g.randn(2 * hq)[::2]}, match=_arg("sinks", CONTIG)),
    ]  # fmt: skip


def _bad_scales(g: Gen, args: tuple, i: int, other: str) -> list[BadInput]:
    """The int8 cache's scales; ``args[i]``, ``args[i + 1]``: the (float32) caches."""
    kc = args[i]
    kq, vq, ks, vs = int8_caches(g, tuple(kc.shape))
    q8 = (*args[:i], kq, vq, *args[i + 2 :])
    s8 = {"key_scale": ks, "value_scale": vs}
    want = "a float32 tensor [num_blocks, block_size, kv_heads] with int8 caches, got None"
    return [
        BadInput("int8 without scales", q8, match=re.escape(f"argument 'key_scale' expected {want}")),
        BadInput("int8 without value_scale", q8, {"key_scale": ks}, match=re.escape(f"argument 'value_scale' expected {want}")),
        BadInput("int8 value_cache alone", (*args[:i], kc, vq, *args[i + 2 :]), s8, match=_arg("value_cache", "dtype float32 (the dtype of 'key_cache')")),
        BadInput("scales with a float cache", args, s8, match=_arg("key_scale", "None with float32 caches (scales go with int8)")),
        BadInput("float64 key_scale", q8, {**s8, "key_scale": ks.double()}, match=_arg("key_scale", "dtype float32")),
        BadInput("value_scale shape", q8, {**s8, "value_scale": vs[:, :-1].contiguous()}, match=_arg("value_scale", f"size {ks.shape[1]} at dim 1 (the shape of 'key_cache')")),
        BadInput("2-d key_scale", q8, {**s8, "key_scale": ks[..., 0]}, match=_arg("key_scale", "3 dimensions")),
        BadInput("strided key_scale", q8, {**s8, "key_scale": g.randn(*ks.shape[:2], 2 * ks.shape[2])[..., ::2]}, match=_arg("key_scale", CONTIG)),
        BadInput("key_scale device", q8, {**s8, "key_scale": ks.to(other)}, match=_arg("key_scale", f"device {kc.device} (the device of 'key_cache')"), crashes_native=CRASH_DEVICE),
    ]  # fmt: skip


def _bad_cache(g: Gen, other: str) -> list[BadInput]:
    key, value, kc, vc = (
        g.randn(5, 2, 16),
        g.randn(5, 2, 16),
        g.randn(3, 4, 2, 16),
        g.randn(3, 4, 2, 16),
    )
    slots = g.ints([0, 5, -1, 11, 2], torch.int64)
    dev = key.device
    return [
        BadInput("int key", (key.int(), value, kc, vc, slots), match=_arg("key", FLOAT)),
        BadInput("strided key", (_strided(g, 5, 2, 16), value, kc, vc, slots), match=_arg("key", STRIDE)),
        BadInput("strided value", (key, _strided(g, 5, 2, 16), kc, vc, slots), match=_arg("value", STRIDE)),
        BadInput("value dtype", (key, value.half(), kc, vc, slots), match=_arg("value", "dtype float32 (the dtype of 'key')")),
        BadInput("value device", (key, value.to(other), kc, vc, slots), match=_arg("value", f"device {dev} (the device of 'key')")),
        BadInput("value shape", (key, g.randn(4, 2, 16), kc, vc, slots), match=_arg("value", "size 5 at dim 0 (the shape of 'key')")),
        BadInput("expanded key_cache", (key, value, _expanded(g, 3, 4, 2, 16), vc, slots), match=_arg("key_cache", CONTIG)),
        BadInput("strided value_cache", (key, value, kc, g.randn(3, 8, 2, 16)[:, ::2], slots), match=_arg("value_cache", CONTIG)),
        BadInput("cache heads", (key, value, g.randn(3, 4, 3, 16), vc, slots), match=_arg("key_cache", "size 2 at dim 2 (kv heads of 'key')")),
        BadInput("cache dtype", (key, value, kc.half(), vc, slots), match=_arg("key_cache", "dtype float32 (the dtype of 'key') or int8 (with 'key_scale' and 'value_scale')")),
        *_bad_scales(g, (key, value, kc, vc, slots), 2, other),
        BadInput("value_cache blocks", (key, value, kc, g.randn(2, 4, 2, 16), slots), match=_arg("value_cache", "size 3 at dim 0 (the shape of 'key_cache')")),
        BadInput("float slots", (key, value, kc, vc, slots.float()), match=_arg("slot_mapping", INDEX)),
        BadInput("slots size", (key, value, kc, vc, slots[:4]), match=_arg("slot_mapping", "size 5 at dim 0 (tokens of 'key')")),
        BadInput("slot past the cache", (key, value, kc, vc, g.ints([0, 12, -1, 1, 2], torch.int64)), match=_value("slot_mapping", "slots below 12 (num_blocks * block_size), got"), value_check=True),
    ]  # fmt: skip


def _bad_moe_topk(g: Gen, other: str) -> list[BadInput]:
    x = g.randn(5, 8)
    dev = x.device
    return [
        BadInput("3-d logits", (x[None], 2), match=_arg("router_logits", "2 dimensions")),
        BadInput("int logits", (x.int(), 2), match=_arg("router_logits", FLOAT)),
        BadInput("top_k 0", (x, 0), match=re.escape("argument 'top_k' expected a value in [1, 8] (the number of experts), got 0")),
        BadInput("top_k 9", (x, 9), match=re.escape("argument 'top_k' expected a value in [1, 8] (the number of experts), got 9")),
        BadInput("scoring", (x, 2), {"scoring": "relu"}, match=re.escape("argument 'scoring' expected 'softmax' or 'sigmoid', got 'relu'")),
        BadInput("bias size", (x, 2), {"correction_bias": g.randn(7)}, match=_arg("correction_bias", "size 8 at dim 0 (the number of experts)")),
        BadInput("int bias", (x, 2), {"correction_bias": g.randn(8).int()}, match=_arg("correction_bias", FLOAT)),
        BadInput("bias device", (x, 2), {"correction_bias": g.randn(8).to(other)}, match=_arg("correction_bias", f"device {dev} (the device of 'router_logits')"), crashes_native=CRASH_DEVICE),
    ]  # fmt: skip


def _bad_fused_moe(g: Gen, other: str) -> list[BadInput]:
    x, wgu, wd = g.randn(4, 16), g.randn(3, 16, 16), g.randn(3, 16, 8)
    tw, ids = g.rand(4, 2), g.ints([[0, 2], [1, 1], [2, 0], [0, 1]], torch.int64)
    dev, hs = x.device, "hidden_states"
    return [
        BadInput("int hidden", (x.int(), wgu, wd, tw, ids), match=_arg(hs, FLOAT)),
        BadInput("w_gate_up dtype", (x, wgu.half(), wd, tw, ids), match=_arg("w_gate_up", "dtype float32 (the dtype of 'hidden_states')")),
        BadInput("w_gate_up device", (x, wgu.to(other), wd, tw, ids), match=_arg("w_gate_up", f"device {dev} (the device of 'hidden_states')")),
        BadInput("w_gate_up hidden", (x, g.randn(3, 16, 12), wd, tw, ids), match=_arg("w_gate_up", "size 16 at dim 2 (the hidden size of 'hidden_states')")),
        BadInput("strided w_gate_up", (x, g.randn(3, 16, 16).transpose(1, 2), wd, tw, ids), match=_arg("w_gate_up", CONTIG)),
        BadInput("odd w_gate_up", (x, g.randn(3, 15, 16), wd, tw, ids), match=_arg("w_gate_up", "an even size at dim 1 ([gate; up] rows)")),
        BadInput("w_down experts", (x, wgu, g.randn(2, 16, 8), tw, ids), match=_arg("w_down", "size 3 at dim 0 (the experts of 'w_gate_up')")),
        BadInput("w_down inter", (x, wgu, g.randn(3, 16, 7), tw, ids), match=_arg("w_down", "size 8 at dim 2 (half of dim 1 of 'w_gate_up')")),
        BadInput("strided w_down", (x, wgu, g.randn(3, 8, 16).transpose(1, 2), tw, ids), match=_arg("w_down", CONTIG)),
        BadInput("topk_weights tokens", (x, wgu, wd, tw[:3], ids), match=_arg("topk_weights", "size 4 at dim 0 (the tokens of 'hidden_states')")),
        BadInput("topk_weights dtype", (x, wgu, wd, tw.bfloat16(), ids), match=_arg("topk_weights", "dtype float32 (the dtype of 'hidden_states')")),
        BadInput("topk_weights device", (x, wgu, wd, tw.to(other), ids), match=_arg("topk_weights", f"device {dev} (the device of 'hidden_states')"), crashes_native=CRASH_DEVICE),
        BadInput("float topk_ids", (x, wgu, wd, tw, ids.float()), match=_arg("topk_ids", INDEX)),
        BadInput("topk_ids device", (x, wgu, wd, tw, ids.to(other)), match=_arg("topk_ids", f"device {dev} (the device of 'hidden_states')"), crashes_native=CRASH_DEVICE),
        BadInput("topk_ids k", (x, wgu, wd, tw, g.ints([[0, 1, 2]] * 4, torch.int64)), match=_arg("topk_ids", "size 2 at dim 1 (the top-k of 'topk_weights')")),
        BadInput("activation", (x, wgu, wd, tw, ids), {"activation": "relu"}, match=re.escape("activation 'relu' is not one of 'silu', 'gelu', 'gelu_tanh'")),
        BadInput("expert id", (x, wgu, wd, tw, g.ints([[0, 3], [1, 1], [2, 0], [0, 1]], torch.int64)), match=r"argument 'topk_ids' holds .*expert id.*" + re.escape("[0, 3) (the experts of 'w_gate_up')"), value_check=True),
    ]  # fmt: skip


def _bad_linear(g: Gen, other: str) -> list[BadInput]:
    x, w, b = g.randn(3, 16), g.randn(8, 16), g.randn(8)
    dev = x.device
    return [
        BadInput("int input", (x.int(), w.int(), b), match=_arg("input", FLOAT)),
        BadInput("0-d input", (x[0, 0], w), match=_arg("input", "at least 1 dimensions")),
        BadInput("weight dtype", (x, w.bfloat16(), b), match=_arg("weight", "dtype float32 (the dtype of 'input')")),
        BadInput("weight device", (x, w.to(other), b), match=_arg("weight", f"device {dev} (the device of 'input')")),
        BadInput("3-d weight", (x, w[None], b), match=_arg("weight", "2 dimensions")),
        BadInput("weight in features", (x, g.randn(8, 15), b), match=_arg("weight", "size 16 at dim 1 (the last dim of 'input')")),
        BadInput("strided weight", (x, g.randn(16, 8).t(), b), match=_arg("weight", CONTIG)),
        BadInput("bias size", (x, w, g.randn(9)), match=_arg("bias", "size 8 at dim 0 (the output features of 'weight')")),
        BadInput("bias dtype", (x, w, b.half()), match=_arg("bias", "dtype float32 (the dtype of 'input')")),
        BadInput("bias device", (x, w, b.to(other)), match=_arg("bias", f"device {dev} (the device of 'input')")),
    ]  # fmt: skip


def _bad_all_reduce(g: Gen, other: str) -> list[BadInput]:
    return [
        BadInput("int input", (g.randn(3, 8).int(), "0"), match=_arg("input", FLOAT)),
        BadInput("empty group name", (g.randn(3, 8), ""), match=re.escape("argument 'group_name' expected a process group name (pg.group_name), got ''")),
    ]  # fmt: skip


def _bad_fused_all_reduce(g: Gen, other: str) -> list[BadInput]:
    x, r, w = g.randn(3, 8), g.randn(3, 8), g.randn(8)
    return [
        BadInput("strided residual", (x, g.randn(8, 3).t(), w, 1e-6, "0"), match=_arg("residual", CONTIG)),
        BadInput("weight size", (x, r, g.randn(7), 1e-6, "0"), match=_arg("weight", "size 8 at dim 0 (the hidden size of 'input')")),
        BadInput("empty group name", (x, r, w, 1e-6, ""), match=re.escape("argument 'group_name' expected a process group name (pg.group_name), got ''")),
    ]  # fmt: skip


BAD_INPUTS: dict[str, Callable[[Gen, str], list[BadInput]]] = {
    "rms_norm": _bad_rms_norm,
    "fused_add_rms_norm": _bad_add_norm,
    "rotary_embedding": _bad_rotary,
    "silu_and_mul": _bad_gated("silu_and_mul"),
    "gelu_and_mul": _bad_gated("gelu_and_mul"),
    "attention": _bad_attention,
    "paged_attention": _bad_paged,
    "reshape_and_cache": _bad_cache,
    "moe_topk": _bad_moe_topk,
    "fused_moe": _bad_fused_moe,
    "linear": _bad_linear,
    "linear_q": quant_cases.bad_linear_q,
    "fused_moe_q": quant_cases.bad_fused_moe_q,
    "embedding_q": quant_cases.bad_embedding_q,
    "all_reduce": _bad_all_reduce,
    "fused_all_reduce_add_rms_norm": _bad_fused_all_reduce,
}


# --- NaN, inf and empty inputs ------------------------------------------------------------
def _put(t: torch.Tensor, index: tuple, value: float) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


def _special_norm(g: Gen) -> list[Special]:
    x, w = g.randn(4, 24), g.randn(24)
    return [
        Special("nan: its row is NaN", (_put(x, (1, 5), NAN), w, 1e-6)),
        Special("inf: its row is NaN/0", (_put(x, (2, 0), INF), w, 1e-6)),
        Special("empty rows", (g.randn(0, 24), w, 1e-6)),
        Special("empty hidden", (g.randn(3, 0), g.randn(0), 1e-6)),
    ]


def _special_add_norm(g: Gen) -> list[Special]:
    x, r, w = g.randn(4, 24), g.randn(4, 24), g.randn(24)
    return [
        Special("nan", (_put(x, (1, 5), NAN), r, w, 1e-6)),
        Special("inf residual", (x, _put(r, (0, 3), -INF), w, 1e-6)),
        Special("empty", (g.randn(0, 24), g.randn(0, 24), w, 1e-6)),
    ]


def _special_rotary(g: Gen) -> list[Special]:
    pos, cache = g.ints([0, 3, 7], torch.int64), cos_sin(g, 8, 16)
    q, k = g.randn(3, 32), g.randn(3, 16)
    return [
        Special("nan query", (pos, _put(q, (1, 2), NAN), k, 16, cache, True)),
        Special("inf key", (pos, q, _put(k, (2, 9), INF), 16, cache, False)),
        Special("empty", (pos[:0], q[:0], k[:0], 16, cache, True)),
    ]


def _special_gated(approx: str | None) -> Callable[[Gen], list[Special]]:
    def special(g: Gen) -> list[Special]:
        extra = (approx,) if approx else ()
        x = _put(_put(g.randn(3, 16), (0, 1), NAN), (1, 12), NAN)  # a gate and an up
        # inf in the up half only: act(gate) * inf is inf (an infinite gate is not
        # specified: torch's silu(-inf) and gelu(inf) are NaN, the kernels take limits)
        y = _put(_put(g.randn(3, 16), (0, 9), INF), (1, 12), -INF)
        return [
            Special("nan", (x, *extra)),
            Special("inf up", (y, *extra)),
            Special("empty", (g.randn(0, 16), *extra)),
        ]

    return special


def _special_attention(g: Gen) -> list[Special]:
    q, k, v = g.randn(1, 6, 2, 16), g.randn(1, 6, 2, 16), g.randn(1, 6, 2, 16)
    mask = _put(torch.zeros(1, 1, 6, 6, device=q.device), (0, 0, 2), -INF)
    return [
        Special("nan key: rows that see it", (q, _put(k, (0, 3, 1, 4), NAN), v), {"causal": True}),
        Special("nan query: its row", (_put(q, (0, 4, 0, 2), NAN), k, v)),
        Special("-inf mask row: zeros", (q, k, v), {"mask": mask}, finite=True),
        Special("no queries", (q[:, :0], k, v), {"causal": True}),
        Special("no keys: zeros", (q, k[:, :0], v[:, :0])),
        Special("sinks, no keys: zeros", (q, k[:, :0], v[:, :0]), {"sinks": g.randn(2)}),
        Special("sinks, window 0", (q, k, v), {"causal": True, "window_left": 0, "sinks": g.randn(2)}, finite=True),
        Special("nan sink: its head", (q, k, v), {"causal": True, "sinks": _put(g.randn(2), (1,), NAN)}),
        Special("-inf sink: none", (q, k, v), {"sinks": torch.full((2,), -INF, device=q.device)}, finite=True),
        Special("nan sink, -inf mask row: zeros there", (q, k, v), {"mask": mask, "sinks": _put(g.randn(2), (0,), NAN)}),
    ]  # fmt: skip


def _special_paged(g: Gen) -> list[Special]:
    q, kc, vc, bt, sl = paged(g, [5, 2], 2, 1, 16, 4)
    used = {int(b) for b in bt[0, :2]} | {int(bt[1, 0])}
    kn, vn = kc.clone(), vc.clone()
    kq, vq, ks, vs = int8_caches(g, tuple(kc.shape))
    for b in range(kc.shape[0]):  # NaN in every slot no sequence reads
        lo = 0 if b not in used else (1 if b == int(bt[0, 1]) else 2 if b == int(bt[1, 0]) else 4)
        kn[b, lo:], vn[b, lo:] = NAN, NAN
        ks[b, lo:], vs[b, lo:] = NAN, NAN
    s8 = {"key_scale": ks, "value_scale": vs}
    return [
        Special("nan in unread cache slots", (q, kn, vn, bt, sl), finite=True),
        Special("int8: nan scales in unread slots", (q, kq, vq, bt, sl), s8, finite=True),
        Special("int8: nan query", (_put(q, (1, 0, 3), NAN), kq, vq, bt, sl), s8),
        Special("nan query", (_put(q, (1, 0, 3), NAN), kc, vc, bt, sl)),
        Special("no sequences", (q[:0], kc, vc, bt[:0], sl[:0])),
        Special("sinks, seq_len 0: zeros", (q, kc, vc, bt, sl * 0), {"sinks": _put(g.randn(2), (1,), NAN)}, finite=True),
        Special("nan sink: its head", (q, kc, vc, bt, sl), {"sinks": _put(g.randn(2), (0,), NAN)}),
        Special("large sinks", (q, kn, vn, bt, sl), {"sinks": torch.full((2,), 80.0, device=q.device)}, finite=True),
    ]  # fmt: skip


def _special_cache(g: Gen) -> list[Special]:
    key, value = _put(g.randn(3, 2, 16), (0, 1, 2), NAN), _put(g.randn(3, 2, 16), (1, 0, 0), -INF)
    kc, vc, slots = g.randn(2, 4, 2, 16), g.randn(2, 4, 2, 16), g.ints([4, -1, 7], torch.int64)
    kq, vq, ks, vs = int8_caches(g, tuple(kc.shape))
    return [
        Special("nan and inf copied", (key, value, kc, vc, slots)),
        Special(
            "int8: nan / inf rows get nan / inf scales",
            (key, value, kq, vq, slots),
            {"key_scale": ks, "value_scale": vs},
        ),
        Special("no tokens", (key[:0], value[:0], kc, vc, slots[:0])),
    ]


def _special_moe_topk(g: Gen) -> list[Special]:
    x = g.randn(4, 8)
    return [
        Special("nan logit softmax", (_put(x, (1, 5), NAN), 2), {"renormalize": True}),
        Special("nan logit sigmoid", (_put(x, (2, 3), NAN), 3), {"scoring": "sigmoid"}),
        Special("-inf logit: never chosen", (_put(x, (0, 0), -INF), 3), finite=True),
        Special("no tokens", (x[:0], 2)),
    ]


def _special_fused_moe(g: Gen) -> list[Special]:
    x, wgu, wd = g.randn(5, 16), g.randn(3, 16, 16, scale=0.25), g.randn(3, 16, 8, scale=0.3)
    tw, ids = g.rand(5, 2), g.ints([[0, 2], [1, 1], [2, 0], [0, 1], [2, 1]], torch.int64)
    return [
        Special("nan token: its row only", (_put(x, (2, 7), NAN), wgu, wd, tw, ids)),
        Special("inf token", (_put(x, (4, 0), INF), wgu, wd, tw, ids)),
        Special("no tokens", (x[:0], wgu, wd, tw[:0], ids[:0])),
    ]


def _special_linear(g: Gen) -> list[Special]:
    x, w, b = g.randn(4, 24), g.randn(9, 24), g.randn(9)
    return [
        Special("nan input row", (_put(x, (1, 3), NAN), w, b)),
        Special("inf weight", (x, _put(w, (2, 5), INF))),
        Special("no rows", (x[:0], w, b)),
        Special("K = 0: the bias", (g.randn(3, 0), g.randn(9, 0), b)),
    ]


def _special_all_reduce(g: Gen) -> list[Special]:
    return [
        Special("nan", (_put(g.randn(3, 8), (0, 0), NAN), group_name())),
        Special("empty", (g.randn(0, 8), group_name())),
    ]


def _special_fused_all_reduce(g: Gen) -> list[Special]:
    x, r, w = g.randn(3, 8), g.randn(3, 8), g.randn(8)
    return [
        Special("nan", (_put(x, (1, 1), NAN), r, w, 1e-6, group_name())),
        Special("empty", (x[:0], r[:0], w, 1e-6, group_name())),
    ]


SPECIAL_INPUTS: dict[str, Callable[[Gen], list[Special]]] = {
    "rms_norm": _special_norm,
    "fused_add_rms_norm": _special_add_norm,
    "rotary_embedding": _special_rotary,
    "silu_and_mul": _special_gated(None),
    "gelu_and_mul": _special_gated("tanh"),
    "attention": _special_attention,
    "paged_attention": _special_paged,
    "reshape_and_cache": _special_cache,
    "moe_topk": _special_moe_topk,
    "fused_moe": _special_fused_moe,
    "linear": _special_linear,
    "linear_q": quant_cases.special_linear_q,
    "fused_moe_q": quant_cases.special_fused_moe_q,
    "embedding_q": quant_cases.special_embedding_q,
    "all_reduce": _special_all_reduce,
    "fused_all_reduce_add_rms_norm": _special_fused_all_reduce,
}


def bad_inputs(op: str, device: str) -> list[BadInput]:
    return BAD_INPUTS[op](Gen(device, seed=1), other_device(device))


def special_inputs(op: str, device: str) -> list[Special]:
    return SPECIAL_INPUTS[op](Gen(device, seed=2))


# --- calling one path ----------------------------------------------------------------------
DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}


def call_native(spec: OpSpec, device: str, args: tuple, kwargs: dict) -> object:
    """The kernel registered at ``device``'s dispatch key, and nothing else (a tensor of
    another device does not move the call to that device's kernel)."""
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, DISPATCH_KEY[device]))
    return spec.overload.redispatch(keys, *args, **kwargs)


def call_fallback(spec: OpSpec, args: tuple, kwargs: dict) -> object:
    """The reference fallback (what ``CompositeExplicitAutograd`` runs), called directly;
    its once-per-device warning silenced (it would say the device has no kernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return spec.fallback(*args, **kwargs)


def call_fake(spec: OpSpec, args: tuple, kwargs: dict) -> object:
    """The fake kernel, under ``FakeTensorMode``."""
    with FakeTensorMode() as mode:
        fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
        return spec.overload(*map(fake, args), **{k: fake(v) for k, v in kwargs.items()})


def error_of(fn: Callable[[], object]) -> str | None:
    """The message of the ``RuntimeError`` that ``fn`` raises (None if it returns)."""
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return None


_SUBPROCESS = """
import sys
sys.path.insert(0, {tests!r})
import torch_topg
from op_bad_inputs import bad_inputs, call_native, error_of
case = next(c for c in bad_inputs({op!r}, {device!r}) if c.desc == {desc!r})
spec = torch_topg.ops.OPS[{op!r}]
msg = error_of(lambda: call_native(spec, {device!r}, case.args, case.kwargs))
print("NO ERROR" if msg is None else "ERROR " + msg)
"""


@functools.cache
def native_error(op: str, device: str, desc: str) -> str | None:
    """The native kernel's message for the bad input ``desc`` of ``op``; cases marked
    ``crashes_native`` run in a subprocess, whose death by a signal fails the test."""
    case = next(c for c in bad_inputs(op, device) if c.desc == desc)
    spec = OPS[op]
    if not case.crashes_native or device != "cpu":  # (the CUDA bindings check devices)
        return error_of(lambda: call_native(spec, device, case.args, case.kwargs))
    code = _SUBPROCESS.format(
        tests=str(pathlib.Path(__file__).parent), op=op, device=device, desc=desc
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    if proc.returncode < 0:
        raise AssertionError(
            f"the native {device} kernel of topg::{op} died of {signal.Signals(-proc.returncode).name} "
            f"on '{desc}' ({case.crashes_native}): the check is missing"
        )
    out = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and out, f"subprocess failed:\n{proc.stdout}\n{proc.stderr}"
    return None if out[-1] == "NO ERROR" else out[-1].removeprefix("ERROR ")
